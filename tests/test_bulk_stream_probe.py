"""benchmarks/bulk_stream_probe.py: its launch structs against cuda.h, and its kernel list
against what the CUDA source instantiates (the probe finds kernels by name in the cubin).
Needs nvcc and gcc, no GPU."""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

from benchmark_module import cuda_include, load

LAYOUT_C = """
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %d %d\\n", sizeof(CUlaunchAttribute),
         offsetof(CUlaunchAttribute, value), sizeof(CUlaunchConfig),
         offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
         offsetof(CUlaunchConfig, numAttrs),
         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
         (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);
  return 0;
}
"""


def test_launch_structs_match_cuda_h(tmp_path: Path) -> None:
    probe = load("bulk_stream_probe")
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text(LAYOUT_C)
    subprocess.run(["gcc", f"-I{cuda_include()}", "-o", str(exe), str(src)], check=True)
    want = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True,
                                           check=True).stdout.split()]  # fmt: skip
    got = [ctypes.sizeof(probe.LaunchAttribute), probe.LaunchAttribute.value.offset,
           ctypes.sizeof(probe.LaunchConfig), probe.LaunchConfig.stream.offset,
           probe.LaunchConfig.attrs.offset, probe.LaunchConfig.num_attrs.offset,
           probe.PROGRAMMATIC_STREAM_SERIALIZATION, probe.CLUSTER_DIMENSION]  # fmt: skip
    assert got == want


ATTRIBUTES_C = """
#include <cuda.h>
#include <stdio.h>
#include <string.h>
static void dump(const CUlaunchAttribute* a) {
  const unsigned char* b = (const unsigned char*)a;
  for (size_t i = 0; i < sizeof(*a); ++i) printf("%02x", b[i]);
  printf("\\n");
}
int main(void) {
  CUlaunchAttribute a;
  memset(&a, 0, sizeof(a));
  a.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  a.value.clusterDim.x = 4;
  a.value.clusterDim.y = 1;
  a.value.clusterDim.z = 1;
  dump(&a);
  memset(&a, 0, sizeof(a));
  a.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  a.value.programmaticStreamSerializationAllowed = 1;
  dump(&a);
  return 0;
}
"""


def test_launch_attributes_hold_what_cuda_h_sets(tmp_path: Path) -> None:
    """The cluster and dependent-launch attributes byte for byte as cuda.h's fields set them
    (a cluster of 4 is (4, 1, 1): z once read 0, and the driver refused every launch)."""
    probe = load("bulk_stream_probe")
    src, exe = tmp_path / "attrs.c", tmp_path / "attrs"
    src.write_text(ATTRIBUTES_C)
    subprocess.run(["gcc", f"-I{cuda_include()}", "-o", str(exe), str(src)], check=True)
    want = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    got = [
        bytes(probe.launch_attribute(probe.CLUSTER_DIMENSION, 4, 1, 1)).hex(),
        bytes(probe.launch_attribute(probe.PROGRAMMATIC_STREAM_SERIALIZATION, 1)).hex(),
    ]
    assert got == want


def test_kernel_list_is_what_the_cubin_holds(tmp_path: Path) -> None:
    probe = load("bulk_stream_probe")
    probe.build(tmp_path)
    cubin = (tmp_path / probe.CUBIN).read_bytes()
    entries = set(re.findall(rb"\.text\.((?:bulk|ldg)_R\d+_K\d+_[SU]\d+_W\d+)\x00", cubin))
    names = [k["name"] for k in probe.kernels()]
    assert names and {n.encode() for n in names} == entries
    for k in probe.kernels():
        consumers = int(k["name"].rsplit("W", 1)[1])
        assert k["threads"] == 32 * (consumers + (k["kind"] == "bulk"))  # + the producer warp
        # the bulk kernel's ring: S stages of R rows of KC + 8 bf16, then 2 S mbarriers
        want = k["depth"] * k["rows"] * (k["kc"] + 8) * 2 + 16 * k["depth"]
        assert k["shared"] == (want if k["kind"] == "bulk" else 0)
