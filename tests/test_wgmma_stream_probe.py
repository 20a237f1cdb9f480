"""benchmarks/wgmma_stream_probe.py: its tensor-map enums against cuda.h, and its kernel list
and shared-memory sizes against what the CUDA source instantiates (the probe finds kernels by
name in the cubin). Needs nvcc and gcc, no GPU."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from benchmark_module import cuda_include, load

ENUMS_C = """
#include <cuda.h>
#include <stdio.h>
int main(void) {
  printf("%d %d %d\\n", (int)CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (int)CU_TENSOR_MAP_SWIZZLE_128B,
         (int)CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  return 0;
}
"""


def test_tensor_map_enums_match_cuda_h(tmp_path: Path) -> None:
    probe = load("wgmma_stream_probe")
    src, exe = tmp_path / "enums.c", tmp_path / "enums"
    src.write_text(ENUMS_C)
    subprocess.run(["gcc", f"-I{cuda_include()}", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    assert [probe.BF16, probe.SWIZZLE_128B, probe.L2_256B] == [int(v) for v in out.split()]


def test_kernel_list_is_what_the_cubin_holds(tmp_path: Path) -> None:
    probe = load("wgmma_stream_probe")
    probe.build(tmp_path)
    cubin = (tmp_path / probe.CUBIN).read_bytes()
    names = rb"w[gct]\d_n\d+_s\d+_k\d|we\d_\d_n\d+_s\d+"
    entries = set(re.findall(rb"\.text\.(" + names + rb")\x00", cubin))
    kernels = probe.kernels()
    assert kernels and {k["name"].encode() for k in kernels} == entries
    for k in kernels:
        stage = k["rows"] * 128 + k["bn"] * 128  # a weight tile and an X tile of 64 k (128 B)
        assert stage % 1024 == 0  # every tile on the 128-byte swizzle's 1,024-byte period
        # the ring, its 2 mbarriers a stage, the slack to align it; a cluster's block's sums;
        # an epilogue's squares of X's rows and warpgroup 1's values for warpgroup 0
        sums = k["rows"] * k["bn"] * 4 if k["cluster"] else 0
        sums += (k["bn"] + 64 * k["bn"]) * 4 if k["epi"] else 0
        assert k["shared"] == k["stages"] * (stage + 16) + 1024 + sums <= probe.SHARED_PER_SM
        kind = "we" if k["epi"] else "wc" if k["cluster"] else "wt" if k["ticket"] else "wg"
        assert k["name"].startswith(kind) and not (k["ticket"] and k["ksplit"] == 1)
        assert k["threads"] == k["rows"] * 2 + 32  # a warpgroup per 64 rows, and the producer warp
