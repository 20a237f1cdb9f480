"""Probe: decode_wide's GEMV as a swapped tensor-core GEMM on sm_90a. out = X · Wᵀ for a batch
of 16 (or 32) rows computed as (W · Xᵀ)ᵀ: the weight is wgmma's A, m64 a warpgroup straight
from shared memory, the batch its N, so no weight byte passes through registers (decode_wide's
GEMV loads every weight fragment into registers and streams at 62-74% of copy bandwidth at 16
rows: docs/performance.md, session 35). A producer warp streams (weight tile, X tile) pairs by
TMA through a ring of mbarriers; the grid is persistent over (row tile, k split) items, the k
splits' partial sums added by fp32 atomics, or (CLUSTER kernels, a block an item) by a cluster
of a row tile's splits through distributed shared memory, in a fixed order. EPILOGUE kernels
fold decode's RMSNorm scale (squares summed from the X tiles) and, for gate_up, SwiGLU across
the two warpgroups, checked against torch's norm and SwiGLU. Timed beside
cuBLAS (torch.nn.functional.linear) and the copy bandwidth of the same run. CUDA source:
benchmarks/probes/wgmma_stream.cu; not part of any library.

  here (nvcc, no GPU):  python benchmarks/wgmma_stream_probe.py build DIR
  on the GPU server:    python benchmarks/wgmma_stream_probe.py run DIR [--out docs/results]
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import bulk_stream_probe
from bulk_stream_probe import CALLS, SHARED_PER_SM, SMS, Driver, _graph_us
from common import build_or_run

SOURCE = Path(__file__).parent / "probes" / "wgmma_stream.cu"
CUBIN = "wgmma_stream.cubin"
SHAPES = {**bulk_stream_probe.SHAPES, "qkv": (10240, 2560)}  # 4B, (N, K)
BF16, SWIZZLE_128B, L2_256B = 9, 3, 3  # cuda.h's CUtensorMap enums


def build(out: Path) -> None:
    bulk_stream_probe.build_cubin(SOURCE, out / CUBIN)


def kernels() -> list[dict]:
    """The kernels the source instantiates: PROBE(WG, BN, STAGES, KSPLIT) lines (k splits added
    by atomics), CLUSTER(...) lines (added in a cluster, in rank order), TICKET(...) lines (added
    in split order by the last split of a row tile to take its ticket) and EPILOGUE(WG, BN,
    STAGES, EPI) lines (no split; EPI 1 the RMSNorm's scale folded in, 2 that and SwiGLU)."""
    found = []
    pattern = r"^(PROBE|CLUSTER|TICKET|EPILOGUE)\((\d+), (\d+), (\d+), (\d+)\)"
    for m in re.finditer(pattern, SOURCE.read_text(), re.M):
        kind = m.group(1)
        wg, bn, stages, last = map(int, m.groups()[1:])
        ksplit, epi = (1, last) if kind == "EPILOGUE" else (last, 0)
        # the ring, 2 mbarriers a stage, the slack to align the ring; a cluster's block also
        # keeps its sums, fp32, for rank 0; an epilogue's its X rows' squares and the values
        # warpgroup 1 hands warpgroup 0
        shared = stages * (64 * wg * 128 + bn * 128) + 16 * stages + 1024
        shared += {"CLUSTER": 64 * wg * bn * 4, "EPILOGUE": (bn + 64 * bn) * 4}.get(kind, 0)
        prefix = {"CLUSTER": "wc", "TICKET": "wt"}.get(kind, "wg")
        name = f"we{epi}_{wg}_n{bn}_s{stages}" if epi else f"{prefix}{wg}_n{bn}_s{stages}_k{ksplit}"
        found.append({"name": name, "rows": 64 * wg, "bn": bn, "stages": stages,
                      "ksplit": ksplit, "cluster": kind == "CLUSTER", "ticket": kind == "TICKET",
                      "epi": epi, "threads": wg * 128 + 32, "shared": shared})  # fmt: skip
    return found


def tensor_map(drv: Driver, ptr: int, rows: int, k: int, box_rows: int):
    """A 2-D bf16 tensor map of [rows, k] (row-major), boxes of box_rows x 64, 128-byte
    swizzle, rows past the end read as zeros: the 128 bytes the kernel takes by value."""
    tmap = (ctypes.c_uint64 * 16)()
    rc = drv.cu.cuTensorMapEncodeTiled(
        ctypes.byref(tmap), BF16, 2, ctypes.c_void_p(ptr), (ctypes.c_uint64 * 2)(k, rows),
        (ctypes.c_uint64 * 1)(k * 2), (ctypes.c_uint32 * 2)(64, box_rows),
        (ctypes.c_uint32 * 2)(1, 1), 0, SWIZZLE_128B, L2_256B, 0,
    )  # fmt: skip
    if rc:
        raise RuntimeError(f"cuTensorMapEncodeTiled: CUDA driver error {rc}")
    return tmap


def _row(rows, bw, proj, n, k, batch, kernel, grid, us, err) -> None:
    fields = {"proj": proj, "n": n, "k": k, "batch": batch, "kernel": kernel, "grid": grid}
    mb = (n * k * 2 + batch * k * 2 + batch * n * 2) / 1e6  # the weight, X, the bf16 out
    bulk_stream_probe.record(rows, bw, mb, us, err, fields, ("proj", "batch", "kernel", "grid"))


def _batch(torch, drv: Driver, bw: float, proj: str, ws: list, batch: int, rows: list) -> None:
    """cuBLAS, then every kernel of `batch` columns at its grids."""
    n, k = ws[0].shape
    x = torch.randn(batch, k, device="cuda").to(torch.bfloat16)
    plain = x.float() @ ws[0].float().T
    normed = plain * torch.rsqrt(x.float().square().mean(1, keepdim=True) + 1e-6)
    refs = {0: plain, 1: normed,
            2: torch.nn.functional.silu(normed[:, : n // 2]) * normed[:, n // 2 :]}  # fmt: skip
    out_bf = torch.empty(batch, n, device="cuda", dtype=torch.bfloat16)
    out_f = torch.zeros(batch, n, device="cuda", dtype=torch.float32)
    found = kernels()
    # TICKET kernels' split partials and row tiles' tickets (zero between launches)
    # (a tile's fragments: row tiles of at most 128 rows, 16+ columns)
    partials = torch.empty(
        max(kk["ksplit"] for kk in found) * max(batch, 16) * (n + 128), device="cuda"
    )
    tickets = torch.zeros(n // 64 + 1, device="cuda", dtype=torch.int32)

    def rel_err(got, epi: int = 0) -> float:
        ref = refs[epi]
        return ((got.float() - ref).abs().max() / ref.abs().max()).item()

    def cublas():
        for i in range(CALLS):
            torch.nn.functional.linear(x, ws[i % len(ws)], out=out_bf)

    torch.nn.functional.linear(x, ws[0], out=out_bf)
    err = rel_err(out_bf)  # before the timing, whose calls leave another weight's product
    _row(rows, bw, proj, n, k, batch, "cublas", 0, _graph_us(torch, cublas), err)
    xmap = tensor_map(drv, x.data_ptr(), batch, k, batch)
    for kern in (kk for kk in found if kk["bn"] == batch and (k // 64) % kk["ksplit"] == 0):
        epi = kern["epi"]
        if epi and (k != 2560 or (epi == 2) != (proj == "gate_up")):
            continue  # the norm folds into the k = 2,560 projections, SwiGLU into gate_up's
        fn = drv.function(kern["name"], kern["shared"])
        box = 64 if epi == 2 else kern["rows"]  # SwiGLU: 64 gate rows, then their up rows
        wmaps = [tensor_map(drv, w.data_ptr(), n, k, box) for w in ws]
        out = out_bf if kern["ksplit"] == 1 or kern["cluster"] or kern["ticket"] else out_f
        if epi == 2:  # [batch, n / 2], contiguous
            out = out_bf.view(-1)[: batch * n // 2].view(batch, n // 2)
        items = n // 128 if epi == 2 else -(-n // kern["rows"]) * kern["ksplit"]
        per_sm = max(1, min(SHARED_PER_SM // (kern["shared"] + 1024), 4))
        grids = {min(items, g) for g in (items, *(SMS * j for j in range(1, per_sm + 1)))}
        for grid in [items] if kern["cluster"] else sorted(grids):  # a cluster: a block an item

            def call(i, fn=fn, kern=kern, grid=grid, wmaps=wmaps, out=out):
                args = [wmaps[i % len(wmaps)], xmap, ctypes.c_void_p(out.data_ptr()),
                        ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(batch),
                        ctypes.c_void_p(partials.data_ptr()),
                        ctypes.c_void_p(tickets.data_ptr())]  # fmt: skip
                stream = torch.cuda.current_stream().cuda_stream
                cluster = kern["ksplit"] if kern["cluster"] else 1
                drv.launch(fn, grid, kern["threads"], kern["shared"], stream, args, False,
                           cluster)  # fmt: skip

            out.zero_()
            call(0)
            torch.cuda.synchronize()
            err = rel_err(out, epi)
            us = _graph_us(torch, lambda call=call: [call(i) for i in range(CALLS)])
            _row(rows, bw, proj, n, k, batch, kern["name"], grid, us, err)


def _shape(torch, drv: Driver, bw: float, proj: str, n: int, k: int, rows: list) -> None:
    from common import weight_copies

    ws = weight_copies(torch, n, k, torch.Generator(device="cuda").manual_seed(0))
    for batch in sorted({kern["bn"] for kern in kernels()}):
        _batch(torch, drv, bw, proj, ws, batch, rows)


def run(d: Path, out: Path | None) -> None:
    header = "| proj | batch | kernel | grid | µs a call | of copy bw | max rel err |"
    bulk_stream_probe.run_probe(d / CUBIN, SHAPES, _shape, header, "wgmma_stream_probe.json", out)


if __name__ == "__main__":
    build_or_run(__doc__, build, run)
