"""Probe: does a decode GEMV's weight stream faster through the copy engine? One batch row,
4B's projection shapes; the weight through shared memory by cp.async.bulk (a producer warp a
block, S stages in flight across the block's tiles) or straight into registers (ld.global.nc,
U chunks in flight), both persistent, beside cuBLAS (torch.nn.functional.linear) and the copy
bandwidth of the same run. Each kernel is timed alone and chained by programmatic dependent
launch (its producer streams before the wait, as decode's kernels prefetch). CUDA source:
benchmarks/probes/bulk_stream.cu; not part of any library.

  here (nvcc, no GPU):  python benchmarks/bulk_stream_probe.py build DIR
  on the GPU server:    python benchmarks/bulk_stream_probe.py run DIR [--out docs/results]
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

from common import build_or_run, copy_bandwidth, write_result

SOURCE = Path(__file__).parent / "probes" / "bulk_stream.cu"
CUBIN = "bulk_stream.cubin"
SHAPES = {  # 4B, (N, K)
    "o_proj": (2560, 4096),
    "down": (2560, 9216),
    "in_proj": (12352, 2560),
    "gate_up": (18432, 2560),
}
SMS = 132
SHARED_PER_SM = 227 * 1024
CALLS = 24  # launches a timed graph


def build_cubin(source: Path, cubin: Path) -> None:
    """A probe's CUDA source as an sm_90a cubin (its includes beside it)."""
    from qwen35_tvm.compile.cuda_toolchain import find_nvcc

    cubin.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(find_nvcc()), "-cubin", "-arch=sm_90a", "-O3", "-o", str(cubin),
                    str(source)], check=True)  # fmt: skip
    print(f"built {cubin}")


def build(out: Path) -> None:
    build_cubin(SOURCE, out / CUBIN)


def kernels() -> list[dict]:
    """The kernels the source instantiates, from their names."""
    found = []
    for m in re.finditer(r"^(BULK|LDG)\((\d+), (\d+), (\d+), (\d+)\)", SOURCE.read_text(), re.M):
        kind, r, kc, depth, cw = m.group(1).lower(), *map(int, m.groups()[1:])
        letter = "S" if kind == "bulk" else "U"
        name = f"{kind}_R{r}_K{kc}_{letter}{depth}_W{cw}"
        threads = (cw + 1) * 32 if kind == "bulk" else cw * 32
        shared = depth * r * (kc + 8) * 2 + 16 * depth if kind == "bulk" else 0
        found.append({"name": name, "kind": kind, "rows": r, "kc": kc, "depth": depth,
                      "threads": threads, "shared": shared})  # fmt: skip
    return found


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
CLUSTER_DIMENSION = 4  # CUlaunchAttributeID: its value, three unsigned ints (x, y, z)


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (here as
    16 unsigned ints: an int member is the first, clusterDim the first three)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


def launch_attribute(attr_id: int, *values: int) -> LaunchAttribute:
    """The attribute `attr_id` whose value union starts with `values` (the rest zero). Bytes
    go in as unsigned ints: a c_char array field copies a bytes value only up to its first
    NUL, which once left clusterDim.z zero (CUDA_ERROR_INVALID_CLUSTER_SIZE)."""
    return LaunchAttribute(attr_id, b"", (ctypes.c_uint * 16)(*values))


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


class Driver:
    """The few driver calls the probe needs, through ctypes (torch owns the context)."""

    def __init__(self, cubin: bytes):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.module = ctypes.c_void_p()
        self._check(self.cu.cuModuleLoadData(ctypes.byref(self.module), cubin), "load")

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"CUDA driver error {rc} in {what}")

    def function(self, name: str, shared: int) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        self._check(self.cu.cuModuleGetFunction(ctypes.byref(fn), self.module, name.encode()),
                    name)  # fmt: skip
        if shared > 48 * 1024:
            self._check(self.cu.cuFuncSetAttribute(fn, 8, shared), "max dynamic shared")
        return fn

    def launch(self, fn, grid: int, threads: int, shared: int, stream: int, args: list,
               pdl: bool, cluster: int = 1) -> None:  # fmt: skip
        """With `cluster` > 1, blocks of that many consecutive x indices form a cluster."""
        cfg = self._config(grid, threads, shared, stream, pdl, cluster)
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p)
                                                 for a in args])  # fmt: skip
        self._check(self.cu.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None), "launch")

    def max_active_clusters(self, fn, grid: int, threads: int, shared: int, cluster: int) -> int:
        """cuOccupancyMaxActiveClusters: clusters of `cluster` such blocks resident at once."""
        cfg = self._config(grid, threads, shared, None, False, cluster)
        count = ctypes.c_int()
        rc = self.cu.cuOccupancyMaxActiveClusters(ctypes.byref(count), fn, ctypes.byref(cfg))
        self._check(rc, "occupancy")
        return count.value

    @staticmethod
    def _config(grid: int, threads: int, shared: int, stream, pdl: bool, cluster: int):
        attrs = (LaunchAttribute * 2)()
        used = 0
        if pdl:
            attrs[used] = launch_attribute(PROGRAMMATIC_STREAM_SERIALIZATION, 1)
            used += 1
        if cluster > 1:
            attrs[used] = launch_attribute(CLUSTER_DIMENSION, cluster, 1, 1)  # x, y, z
            used += 1
        cfg = LaunchConfig((grid, 1, 1), (threads, 1, 1), shared, stream, attrs, used)
        cfg.keep = attrs  # the config points into it
        return cfg


def _graph_us(torch, capture) -> float:
    """µs a call of a CUDA graph of CALLS calls (best of 20 replays)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        capture()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / CALLS)
    return best


def record(rows: list, bw: float, mb: float, us: float, err: float, fields: dict,
           shown: tuple) -> None:  # fmt: skip
    """A probe's timing: a JSON row (`fields`, then µs, MB moved, % of the copy bandwidth `bw`
    and the error) into `rows`, and a markdown row of the `shown` fields and the same."""
    pct = round(100 * mb * 1e6 / (us * 1e-6) / bw, 1)
    rows.append({**fields, "us": round(us, 2), "mb": round(mb, 2), "pct_copy_bw": pct,
                 "max_rel_err": err})  # fmt: skip
    cells = " | ".join(str(fields[name]) for name in shown)
    print(f"| {cells} | {us:.2f} | {pct}% | {err:.1e} |", flush=True)


def _row(rows: list, bw: float, proj: str, n: int, k: int, kernel: str, grid: int, pdl: bool,
         us: float, err: float) -> None:  # fmt: skip
    fields = {"proj": proj, "n": n, "k": k, "kernel": kernel, "grid": grid, "pdl": pdl}
    mb = (n * k * 2 + k * 2 + n * 4) / 1e6  # the weight, x, the fp32 out
    record(rows, bw, mb, us, err, fields, ("proj", "kernel", "grid", "pdl"))


def _shape(torch, drv: Driver, bw: float, proj: str, n: int, k: int, rows: list) -> None:
    """cuBLAS, then every kernel of the source at its grids, alone and chained."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(2, -(-4 * l2 // (n * k * 2)))  # every call streams its weight from HBM
    ws = [torch.randn(n, k, device="cuda").mul_(0.02).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    o = torch.empty(1, n, device="cuda", dtype=torch.float32)
    o_bf = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ ws[0].float().T)[0]

    def rel_err(got) -> float:
        return ((got.float() - ref).abs().max() / ref.abs().max()).item()

    torch.nn.functional.linear(x, ws[0], out=o_bf)
    err = rel_err(o_bf[0])

    def cublas():
        for i in range(CALLS):
            torch.nn.functional.linear(x, ws[i % copies], out=o_bf)

    _row(rows, bw, proj, n, k, "cublas", 0, False, _graph_us(torch, cublas), err)
    for kern in kernels():
        if n % kern["rows"] or k % kern["kc"]:
            continue
        fn = drv.function(kern["name"], kern["shared"])
        tiles = n // kern["rows"]
        per_sm = max(1, min(SHARED_PER_SM // (kern["shared"] + 1024), 4))
        grids = {min(g, tiles) for g in (tiles, *(SMS * m for m in range(1, per_sm + 1)))}
        for grid in sorted(grids):

            def call(i, pdl, fn=fn, kern=kern, grid=grid):
                args = [ctypes.c_void_p(ws[i % copies].data_ptr()),
                        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(o.data_ptr()),
                        ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(int(pdl))]  # fmt: skip
                drv.launch(fn, grid, kern["threads"], kern["shared"],
                           torch.cuda.current_stream().cuda_stream, args, pdl)  # fmt: skip

            o.fill_(float("nan"))
            call(0, False)
            torch.cuda.synchronize()
            err = rel_err(o[0])
            for pdl in (False, True):
                us = _graph_us(
                    torch, lambda pdl=pdl, call=call: [call(i, pdl) for i in range(CALLS)]
                )
                _row(rows, bw, proj, n, k, kern["name"], grid, pdl, us, err)


def run_probe(cubin: Path, shapes: dict, shape_rows, header: str, name: str,
              out: Path | None) -> None:  # fmt: skip
    """A probe's run: the copy bandwidth, then `shape_rows(torch, drv, bw, proj, n, k, rows)`
    for each shape, a markdown row a timing, the JSON as `name` in cubin's folder and OUT."""
    import torch

    bw = copy_bandwidth(torch)  # also makes torch's context current for the driver calls
    drv = Driver(cubin.read_bytes())
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    print(header)
    rows: list = []
    for proj, (n, k) in shapes.items():
        shape_rows(torch, drv, bw, proj, n, k, rows)
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(0), "copy_bw_tbs": round(bw / 1e12, 3),
              "calls_a_graph": CALLS, "rows": rows}  # fmt: skip
    write_result(name, result, cubin.parent, out)


def run(d: Path, out: Path | None) -> None:
    header = "| proj | kernel | grid | pdl | µs a call | of copy bw | max rel err |"
    run_probe(d / CUBIN, SHAPES, _shape, header, "bulk_stream_probe.json", out)


if __name__ == "__main__":
    build_or_run(__doc__, build, run)
