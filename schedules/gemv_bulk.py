"""sm_90's weight ring for the decode GEMV (schedules/gemv.py, GemvConfig.bulk): a block's
stages in shared memory, each one chunk of k (one step of every warp) of the block's rows,
filled by the copy engine, one cp.async.bulk a weight row, on the stage's mbarrier; and the
persistent blocks that stream through it.

Why: a register or cp.async ring issues a warp's loads only as fast as its lanes run, and a
block starts cold, after its producer. Here thread 0 keeps `stages` chunks in flight for the
whole block, the grid is persistent (`bulk` blocks an SM) so the ring runs on across a
block's row tiles without a ramp, and its first stages are issued before the block waits for
its producer (the weight is constant: schedules/pdl.py), so they stream while the kernel
before still ends. benchmarks/bulk_stream_probe.py measured the idea: 92-100% of copy
bandwidth chained for 4B's down, in_proj and gate_up on an H100.

The protocol, a stage s and the block's ring step g (its tiles' chunks in order): `full[s]`
counts one arrival (thread 0's, with the stage's bytes) and completes when the copies land;
every thread waits on it for phase g // stages (gemv_layout.ring_phase), reads its 16-byte
pieces into registers for mma, then arrives on `empty[s]` (all threads of the block); thread
0, after its own arrival, waits for `empty[s]` and refills the stage with step g + stages.
A lane reads what it would have loaded from the weight (gemv_layout.load_k's k, load_row's
rows), so the mma fragments, X's ring and the sums' order are accumulate_regs'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tvm.script import tirx as T

from .gemm_match import DTYPE
from .gemv_config import VEC, GemvConfig, cdiv
from .gemv_layout import (
    chunk_k,
    lane_coords,
    load_row,
    ring_phase,
    ring_step_tile,
    stage_offset,
    warp_step,
)
from .pdl import release_dependents, wait_for_producers
from .ptx import is_sm90a

BULK_COPY = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"


class BodyParts(NamedTuple):
    """What the bulk nest takes from gemv_body's kernel: the X loads and the mma of a step,
    the register ring (sm_80's path), a tile's epilogue and the residual's early load."""

    load: Callable
    product: Callable
    accumulate_regs: Callable
    finish: Callable
    load_early: Callable | None
    early_size: int
    warps: Callable
    lanes: Callable


def bulk_ring_elems(cfg: GemvConfig) -> int:
    """bf16 elements of a bulk ring: its stages."""
    return stage_offset(cfg.stages, 0, 0, cfg)


def bulk_ring(k: int, cfg: GemvConfig, grid: int, weight_row: Callable):
    """(init, fill, wait_full, release): the ring's macros for a kernel of `grid` persistent
    blocks over a weight of k columns whose tile row r is weight row weight_row(tile * rows +
    r). `bars`: 2 x stages uint64 in shared memory (full, then empty); `ring`: the stages."""
    stages, rows, chunk = cfg.stages, cfg.rows, cfg.chunk
    chunks = k // chunk
    row_bytes, stage_bytes = chunk * 2, rows * chunk * 2

    def bar(bars, i):
        return T.address_of(bars[i])

    @T.macro
    def init(bars):
        # thread 0, before a block barrier
        for s in T.unroll(stages):
            T.evaluate(T.ptx.mbarrier.init.shared.b64(bar(bars, s), T.uint32(1)))
            T.evaluate(T.ptx.mbarrier.init.shared.b64(bar(bars, stages + s), T.uint32(cfg.threads)))
        # the copy engine (the async proxy) completes bytes on these barriers: the PTX memory
        # model wants their init made visible to it
        T.evaluate(T.ptx.fence.mbarrier_init.release.cluster())
        T.evaluate(T.ptx.fence.proxy.async_.shared__cta())

    @T.macro
    def fill(w, ring, bars, gs, blk):
        # thread 0: stage gs % stages gets ring step gs
        tile, c = T.meta_var(ring_step_tile(gs, blk, grid, chunks))
        slot: T.let[T.int32] = gs % stages
        T.evaluate(T.ptx.mbarrier.arrive.expect_tx.shared.b64(bar(bars, slot),
                                                              T.uint32(stage_bytes)))  # fmt: skip
        for r in T.unroll(rows):
            T.evaluate(
                T.ptx[BULK_COPY](
                    T.address_of(ring[stage_offset(slot, r, 0, cfg)]),
                    T.address_of(w[weight_row(tile * rows + r), c * chunk]),
                    T.uint32(row_bytes),
                    bar(bars, slot),
                )
            )

    @T.macro
    def wait_full(bars, gs):
        T.evaluate(T.cuda.mbarrier_wait(bar(bars, gs % stages), ring_phase(gs, stages)))

    @T.macro
    def release(w, ring, bars, gs, blk, total, first_thread):
        # the thread's reads of step gs's stage are in registers the mma consumed
        empty_at = T.meta_var(bar(bars, stages + gs % stages))
        T.evaluate(T.ptx.mbarrier.arrive.shared.b64(empty_at, T.uint32(1)))
        if first_thread and gs + stages < total:
            T.evaluate(T.cuda.mbarrier_wait(empty_at, ring_phase(gs, stages)))
            fill(w, ring, bars, gs + stages, blk)

    return init, fill, wait_full, release


def bulk_nest(k: int, cfg: GemvConfig, tiles: int, grid: int, weight_row: Callable,
              parts: BodyParts, release_early: bool):  # fmt: skip
    """The macro (x, w, out, extras, batch, blk, col, part, sq_sh, ring, bars) of persistent
    block blk: its tiles blk, blk + grid, ... through one bulk ring on sm_90a; sm_80's code
    takes the register ring a tile at a time in the same grid.

    `release_early`: the kernel behind may be scheduled once this one's wait returns (else at
    its end). Only where that kernel is another GEMV, whose early work is its weight's stages:
    with in_proj's and qkv's grids releasing GDN's decode kernel and the attention's input
    kernel that early, an H100's c1 greedy tokens differed between any two runs of a library;
    released at the end, or never launched dependently, they repeat (3 of 3 each), and the
    rings alone, chained without dependent launch, are bit-exact (benchmarks/
    gemv_determinism.py). The race behind it is not yet located (docs/performance.md, session
    37)."""
    if k % cfg.chunk:
        raise ValueError(f"k {k} must be a multiple of {cfg}'s chunk {cfg.chunk} (bulk)")
    init_ring, fill_ring, wait_full, release_stage = bulk_ring(k, cfg, grid, weight_row)
    load, product, load_early = parts.load, parts.product, parts.load_early
    mt, nt, wks, unroll, stages = cfg.m_tiles, cfg.n_tiles, cfg.warps_k, cfg.unroll, cfg.stages
    xr, n_acc, chunks = cfg.x_ring, 4 * cfg.m_tiles * cfg.n_tiles, k // cfg.chunk

    @T.macro
    def accumulate(w, x, acc, wk, tile, tx, col, batch, sq, ring, bars, first, blk, total):
        # ring steps first.. are this tile's chunks; a warp's step of chunk c is
        # warp_step(c, ...), as accumulate_regs takes them
        w_cur = T.sblock_alloc_buffer((1, unroll, 2 * mt, VEC), DTYPE, scope="local")
        x_reg = T.sblock_alloc_buffer((xr, unroll, nt, VEC), DTYPE, scope="local")
        a_frag = T.sblock_alloc_buffer((mt, 2, 8), DTYPE, scope="local")
        b_frag = T.sblock_alloc_buffer((nt, VEC), DTYPE, scope="local")
        g, q = T.meta_var(lane_coords(tx))
        for d in T.unroll(xr):
            load(w, x, w_cur, x_reg, 0, d, warp_step(d, wk, wks), tile, g, q, col, batch, False,
                 True)  # fmt: skip
        for it in T.serial(cdiv(chunks, xr), annotations={"disable_unroll": 1}):
            for d in T.unroll(xr):
                c: T.let[T.int32] = it * xr + d
                if c < chunks:
                    gs: T.let[T.int32] = first + c
                    wait_full(bars, gs)
                    for u in T.unroll(unroll):
                        for h in T.unroll(2 * mt):
                            at = T.meta_var(stage_offset(gs % stages, load_row(0, h, g, mt),
                                                         chunk_k(u, q, wk, cfg), cfg))  # fmt: skip
                            for v in T.vectorized(VEC):
                                w_cur[0, u, h, v] = ring[at + v]
                    product(w_cur, x_reg, a_frag, b_frag, acc, 0, d, warp_step(c, wk, wks), sq)
                    release_stage(w, ring, bars, gs, blk, total, wk == 0 and tx == 0)
                    load(w, x, w_cur, x_reg, 0, d, warp_step(c + xr, wk, wks), tile, g, q, col,
                         batch, False, True)  # fmt: skip

    @T.macro
    def nest(x, w, out, extras, batch, blk, col, part, sq_sh, ring, bars):
        for wk in parts.warps():
            for tx in parts.lanes():
                with T.sblock("accumulate"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                    sq = T.sblock_alloc_buffer((nt,), "float32", scope="local")
                    early = T.sblock_alloc_buffer((max(parts.early_size, 1),), "float32",
                                                  scope="local")  # fmt: skip
                    mine: T.let[T.int32] = T.ceildiv(tiles - blk, grid)
                    if is_sm90a():
                        if wk == 0 and tx == 0:
                            init_ring(bars)
                        T.tvm_storage_sync("shared")
                        # the weight is constant: its first stages go before the wait
                        if wk == 0 and tx == 0:
                            for s in T.unroll(stages):
                                if s < mine * chunks:
                                    fill_ring(w, ring, bars, s, blk)
                    T.evaluate(wait_for_producers(True))
                    if release_early:
                        T.evaluate(release_dependents(True))
                    for i in T.serial(mine):
                        tile: T.let[T.int32] = blk + i * grid
                        if load_early is not None:
                            load_early(extras, early, wk, tx, tile, col, batch)
                        for e in T.unroll(n_acc):
                            acc[e] = T.float32(0)
                        for j in T.unroll(nt):
                            sq[j] = T.float32(0)
                        if is_sm90a():
                            accumulate(w, x, acc, wk, tile, tx, col, batch, sq, ring, bars,
                                       i * chunks, blk, mine * chunks)  # fmt: skip
                        else:
                            parts.accumulate_regs(w, x, acc, wk, tile, tx, col, batch, sq)
                        parts.finish(out, extras, acc, sq, early, part, sq_sh, wk, tx, tile, col,
                                     batch)  # fmt: skip
                        T.tvm_storage_sync("shared")  # `part` and `sq_sh` free for the next
                    if not release_early:
                        T.evaluate(release_dependents(True))

    return nest
