"""Probe: what the split GEMM's fp32 partials cost a mixed step at one m tile, and what a
cluster's distributed shared memory would cost instead. Nsight Compute found prefill's split
GEMM at M = 128, n = 2,560 L2-bound (docs/performance.md, session 49): beside the weight and A's
re-reads, each call writes 10.5 MB of partials that a second kernel reads back. Here only the
reduction runs, 16 column tiles of 160 x 8 splits of 128 rows (the real grid), each block's
accumulators made from their indices:
  workspace  `ws_store` writes them to [8, 128, n] fp32, `ws_reduce` sums the splits in order,
             adds the residual and stores bf16 (schedules/split_k.py's two kernels);
  dsmem      one kernel, a cluster of a tile's 8 splits: each block keeps its partial in shared
             memory, and after a cluster barrier block r sums its 16 rows from all 8 (in split
             order) through distributed shared memory; asked for 80 KB (the partial) or the
             GEMM's 148.5 KB, to see whether 16 such clusters are resident at once.
Each is timed in a CUDA graph of CALLS calls, without and with dependent launch, and checked
against torch (bf16 out); cuOccupancyMaxActiveClusters says how many clusters of 2, 4 and 8
such blocks an H100/H200 holds at once (16 are needed for one wave). CUDA source:
benchmarks/probes/split_reduce.cu; not part of any library.

  here (nvcc, no GPU):  python benchmarks/split_reduce_probe.py build DIR
  on the GPU server:    python benchmarks/split_reduce_probe.py run DIR [--out docs/results]
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from bulk_stream_probe import CALLS, Driver, _graph_us, build_cubin, record, run_probe
from common import build_or_run

SOURCE = Path(__file__).parent / "probes" / "split_reduce.cu"
CUBIN = "split_reduce.cubin"
M, TILE_N, SPLITS, THREADS = 128, 160, 8, 256
SHAPES = {"n2560": (2560, 0)}  # o_proj, out_proj and down: the reduction does not see k
PARTIAL_BYTES = M * TILE_N * 4
GEMM_SHARED = 148_544  # prefill's split GEMM's dynamic shared memory (ncu, session 49)
# a partial: ((split * A + row * B + col * C) % D) * SCALE - SHIFT, exact in fp32 (the .cu's)
A, B, C, D, SCALE, SHIFT = 131, 7, 3, 97, 0.015625, 0.75


def build(out: Path) -> None:
    build_cubin(SOURCE, out / CUBIN)


def reference(torch, res, n: int):
    """The splits' partials as the kernels make them, summed in split order, plus `res`."""
    at = {"device": res.device}
    s = torch.arange(SPLITS, **at).view(SPLITS, 1, 1)
    row = torch.arange(M, **at).view(1, M, 1)
    col = (torch.arange(n, **at) % TILE_N).view(1, 1, n)
    parts = ((s * A + row * B + col * C) % D).float() * SCALE - SHIFT
    total = parts[0].clone()
    for i in range(1, SPLITS):
        total += parts[i]
    return (total + res.float()).to(torch.bfloat16)


def _shape(torch, drv: Driver, bw: float, proj: str, n: int, _k: int, rows: list) -> None:
    tiles = n // TILE_N
    grid = tiles * SPLITS
    res = torch.randn(M, n, device="cuda").to(torch.bfloat16)
    ws = torch.empty(SPLITS, M, n, device="cuda", dtype=torch.float32)
    out = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
    want = reference(torch, res, n)
    stream = torch.cuda.current_stream().cuda_stream
    store, reduce = drv.function("ws_store", 0), drv.function("ws_reduce", 0)
    dsmem = drv.function("dsmem_reduce", GEMM_SHARED)  # allows up to the larger of the two
    ptr = ctypes.c_void_p

    def workspace(pdl: bool) -> None:
        drv.launch(store, grid, THREADS, 0, stream,
                   [ptr(ws.data_ptr()), ctypes.c_int(n), ctypes.c_int(int(pdl))], pdl)  # fmt: skip
        pairs = -(-M * n // 2 // THREADS)
        drv.launch(reduce, pairs, THREADS, 0, stream,
                   [ptr(ws.data_ptr()), ptr(res.data_ptr()), ptr(out.data_ptr()), ctypes.c_int(n),
                    ctypes.c_int(int(pdl))], pdl)  # fmt: skip

    def cluster(shared: int, pdl: bool) -> None:
        drv.launch(dsmem, grid, THREADS, shared, stream,
                   [ptr(res.data_ptr()), ptr(out.data_ptr()), ctypes.c_int(n),
                    ctypes.c_int(int(pdl))], pdl, cluster=SPLITS)  # fmt: skip

    def err() -> float:
        torch.cuda.synchronize()
        return ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()

    io = 2 * M * n * 2  # the residual read, the output written
    cases = [("workspace", None, 2 * SPLITS * M * n * 4 + io, workspace)]
    cases += [
        (f"dsmem_{b // 1024}k", b, io, lambda pdl, b=b: cluster(b, pdl))
        for b in (PARTIAL_BYTES, GEMM_SHARED)
    ]
    for name, shared, moved, call in cases:
        out.fill_(float("nan"))
        call(False)
        e = err()
        for pdl in (False, True):
            us = _graph_us(torch, lambda call=call, pdl=pdl: [call(pdl) for _ in range(CALLS)])
            fields = {"proj": proj, "n": n, "kernel": name, "pdl": pdl}
            if shared is not None:
                fields["clusters_resident"] = {
                    c: drv.max_active_clusters(dsmem, grid, THREADS, shared, c) for c in (2, 4, 8)
                }
            record(rows, bw, moved / 1e6, us, e, fields, ("proj", "kernel", "pdl"))
    print(f"clusters of 8 needed for one wave: {tiles}")


def run(d: Path, out: Path | None) -> None:
    header = "| proj | kernel | pdl | µs a call | of copy bw | max rel err |"
    run_probe(d / CUBIN, SHAPES, _shape, header, "split_reduce_probe.json", out)


if __name__ == "__main__":
    build_or_run(__doc__, build, run)
