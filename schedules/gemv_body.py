"""The decode GEMV's kernel for one config (schedules/gemv.py holds the design, the bucket
dispatch and the PrimFunc): a macro launching row tiles on blockIdx.x and passes of the batch
on blockIdx.y, with the GPU loop nest (register or shared-memory weight ring, mma) and the CPU
one (the same indices, sums from memory)."""

from __future__ import annotations

from tvm.script import tirx as T

from .gemm_layout import acc_coords
from .gemm_match import DTYPE, Epilogue
from .gemv_bulk import BodyParts, bulk_nest, bulk_ring_elems
from .gemv_config import TILE_COLS, VEC, GemvConfig, bulk_grid, cdiv, min_blocks_per_sm

# the kernel reads the index maps by these names, so tests can mutate them here
from .gemv_layout import (
    acc_index,
    frag_source,
    groups_in_flight,
    lane_coords,
    load_k,
    load_row,
    ring_offset,
    warp_step,
    x_row,
)
from .gemv_store import Pair, block_rows
from .pdl import prefetch_l2, release_dependents, wait_for_producers
from .ptx import cp_async_16, mma_bf16

FULL_MASK = 0xFFFFFFFF
LINE = 64  # bf16 elements of a 128-byte cache line


def pass_kernel(
    n: int,
    k: int,
    cfg: GemvConfig,
    gpu: bool,
    epilogue: Epilogue,
    rms_eps: float | None,
    pair: Pair | None = None,
    extra_shapes: tuple[str, ...] = (),
):
    """A macro (x, w, out, extras, batch) that launches the kernel of one config: row tiles
    on blockIdx.x, passes of cfg.cols batch rows on blockIdx.y. With `rms_eps` X's rows are
    scaled by their 1 / rms on the fly, a norm without weight (see gemv_kernel). With
    `pair`, out [batch, n / 2] column c is pair(epilogue of row c, epilogue of row n / 2 + c):
    a block takes both rows of its columns (gemv_store.block_rows)."""
    cfg.check()
    mt, wks, unroll, stages, rb, step = (
        cfg.m_tiles, cfg.warps_k, cfg.unroll, cfg.stages, cfg.rows, cfg.step
    )  # fmt: skip
    nt, xr, cols, n_acc = cfg.n_tiles, cfg.x_ring, cfg.cols, 4 * cfg.m_tiles * cfg.n_tiles
    tiles, weight_row, store, load_early, early_size = block_rows(
        n, k, cfg, epilogue, rms_eps, pair, extra_shapes
    )
    min_blocks = min_blocks_per_sm(tiles * rb, cfg)
    n_steps = cdiv(k, step)
    per_warp = cdiv(n_steps, wks)
    iters = cdiv(per_warp, stages)
    xrr = cfg.x_ring_regs  # X's ring beside the weight's ring in registers
    same = xrr == stages  # both rings equally deep: a step's loads go together
    ring_elems = cfg.warps_k * cfg.stages * cfg.unroll * 2 * cfg.m_tiles * 32 * VEC
    ring_scope = "shared" if cfg.shared_bytes <= 48 * 1024 else "shared.dyn"
    prefetched = min(cfg.prefetch_steps, per_warp)
    # starts beside its producer (schedules/pdl.py) where its config says (gemv_config)
    dependent = gpu and cfg.dependent
    lines = cdiv(step, LINE)  # L2 lines of a row's step
    rms = rms_eps is not None
    bulk = gpu and cfg.bulk > 0  # the CPU runs a bulk config's sums as any other's
    grid = bulk_grid(tiles, cfg) if bulk else tiles

    def in_k(k0):
        return k0 < k if k % step else True  # a load can fall past k only then

    def live(k0):
        return k0 < k if k % step else None  # cp.async: a predicate only where needed

    def blocks(extent):
        return T.thread_binding(extent, thread="blockIdx.x") if gpu else T.parallel(extent)

    def passes(extent):
        return T.thread_binding(extent, thread="blockIdx.y") if gpu else T.serial(extent)

    def warps():
        return T.thread_binding(wks, thread="threadIdx.y") if gpu else T.serial(wks)

    def lanes():
        return T.thread_binding(32, thread="threadIdx.x") if gpu else T.serial(32)

    @T.macro
    def load(w, x, w_reg, x_reg, d, dx, ks, tile, g, q, col, batch, with_w, with_x):
        if ks < n_steps:
            for u in T.unroll(unroll):
                k0: T.let[T.int32] = load_k(ks, u, q, step)
                if in_k(k0):
                    # rows past n and batch rows past the batch are clamped: they feed only
                    # accumulators that are never stored
                    if with_w:
                        for h in T.unroll(2 * mt):
                            for v in T.vectorized(VEC):
                                w_reg[d, u, h, v] = w[weight_row(load_row(tile, h, g, mt)),
                                                      k0 + v]  # fmt: skip
                    if with_x:
                        for j in T.unroll(nt):
                            for v in T.vectorized(VEC):
                                x_reg[dx, u, j, v] = x[T.min(x_row(col, j, g), batch - 1), k0 + v]
                else:
                    if with_w:
                        for h in T.unroll(2 * mt):
                            for v in T.vectorized(VEC):
                                w_reg[d, u, h, v] = T.Cast(DTYPE, 0)
                    if with_x:
                        for j in T.unroll(nt):
                            for v in T.vectorized(VEC):
                                x_reg[dx, u, j, v] = T.Cast(DTYPE, 0)

    @T.macro
    def product(w_reg, x_reg, a_frag, b_frag, acc, d, dx, ks, sq):
        if ks < n_steps:
            for u in T.unroll(unroll):
                for j in T.unroll(nt):
                    for e in T.unroll(VEC):
                        if rms:  # X's squares for its row's norm (the weight is in W's columns)
                            xv: T.let[T.float32] = T.Cast("float32", x_reg[dx, u, j, e])
                            sq[j] = sq[j] + xv * xv
                        b_frag[j, e] = x_reg[dx, u, j, e]
                for m in T.unroll(mt):
                    for s in T.unroll(2):
                        for e in T.unroll(8):
                            h, v = T.meta_var(frag_source(m, s, e))
                            a_frag[m, s, e] = w_reg[d, u, h, v]
                # each weight fragment meets every n-tile: the weight is read once a pass
                for m in T.unroll(mt):
                    for s in T.unroll(2):
                        for j in T.unroll(nt):
                            T.evaluate(
                                mma_bf16(a_frag.data, (m * 2 + s) * 8, b_frag.data,
                                         j * VEC + s * 4, acc.data, acc_index(m, j, 0, nt))
                            )  # fmt: skip

    @T.macro
    def accumulate_regs(w, x, acc, wk, tile, tx, col, batch, sq):
        w_reg = T.sblock_alloc_buffer((stages, unroll, 2 * mt, VEC), DTYPE, scope="local")
        x_reg = T.sblock_alloc_buffer((xrr, unroll, nt, VEC), DTYPE, scope="local")
        # mma operands are addressed by element offset: plain arrays the loads are copied into
        a_frag = T.sblock_alloc_buffer((mt, 2, 8), DTYPE, scope="local")
        b_frag = T.sblock_alloc_buffer((nt, VEC), DTYPE, scope="local")
        g, q = T.meta_var(lane_coords(tx))
        for d in T.unroll(stages):
            load(w, x, w_reg, x_reg, d, d, warp_step(d, wk, wks), tile, g, q, col, batch, True,
                 same)  # fmt: skip
        if not same:
            for d in T.unroll(xrr):
                load(w, x, w_reg, x_reg, d, d, warp_step(d, wk, wks), tile, g, q, col, batch,
                     False, True)  # fmt: skip
        # kept rolled: unrolled, ptxas hoists every step's loads and spills (255 registers)
        for it in T.serial(iters, annotations={"disable_unroll": 1}):
            for d in T.unroll(stages):
                j: T.let[T.int32] = it * stages + d
                product(w_reg, x_reg, a_frag, b_frag, acc, d, d % xrr, warp_step(j, wk, wks), sq)
                load(w, x, w_reg, x_reg, d, d, warp_step(j + stages, wk, wks), tile, g, q, col,
                     batch, True, same)  # fmt: skip
                if not same:  # X slot d % xrr is free again: the step xrr ahead goes there
                    load(w, x, w_reg, x_reg, d, d % xrr, warp_step(j + xrr, wk, wks), tile, g,
                         q, col, batch, False, True)  # fmt: skip

    @T.macro
    def copy_w(w, w_sh, d, ks, tile, wk, tx, g, q):
        # cp.async of a step's weight into the warp's ring slot d, each lane's 16 bytes at
        # their own place (a lane reads back only what it copied: no barrier); .cg: L2 only,
        # so the weight stream leaves L1 to X. Past k: zero-filled.
        if ks < n_steps:
            for u in T.unroll(unroll):
                k0: T.let[T.int32] = load_k(ks, u, q, step)
                for h in T.unroll(2 * mt):
                    row: T.let[T.int32] = weight_row(load_row(tile, h, g, mt))
                    at: T.let[T.int32] = ring_offset(wk, d, u, h, tx, cfg)
                    T.evaluate(cp_async_16(w_sh.data, at, w.data, row * k + k0, live(k0)))
        T.evaluate(T.ptx["cp.async.commit_group"]())  # every step a group, loads or not

    @T.macro
    def accumulate_smem(w, x, acc, wk, tile, tx, col, batch, sq):
        w_sh = T.sblock_alloc_buffer((ring_elems,), DTYPE, scope=ring_scope)
        w_cur = T.sblock_alloc_buffer((1, unroll, 2 * mt, VEC), DTYPE, scope="local")
        x_reg = T.sblock_alloc_buffer((xr, unroll, nt, VEC), DTYPE, scope="local")
        a_frag = T.sblock_alloc_buffer((mt, 2, 8), DTYPE, scope="local")
        b_frag = T.sblock_alloc_buffer((nt, VEC), DTYPE, scope="local")
        g, q = T.meta_var(lane_coords(tx))
        for d in T.unroll(stages):
            copy_w(w, w_sh, d, warp_step(d, wk, wks), tile, wk, tx, g, q)
        for d in T.unroll(xr):
            load(w, x, w_cur, x_reg, 0, d, warp_step(d, wk, wks), tile, g, q, col, batch, False,
                 True)  # fmt: skip
        # unrolled only over the X ring (its slots are registers); the weight slot is an address
        for it in T.serial(cdiv(per_warp, xr), annotations={"disable_unroll": 1}):
            for d in T.unroll(xr):
                j: T.let[T.int32] = it * xr + d
                slot: T.let[T.int32] = j % stages
                T.evaluate(T.ptx["cp.async.wait_group"](groups_in_flight(stages)))
                for u in T.unroll(unroll):
                    for h in T.unroll(2 * mt):
                        for v in T.vectorized(VEC):
                            w_cur[0, u, h, v] = w_sh[ring_offset(wk, slot, u, h, tx, cfg) + v]
                product(w_cur, x_reg, a_frag, b_frag, acc, 0, d, warp_step(j, wk, wks), sq)
                # the slot was read into registers the mma above consumed: refill it
                copy_w(w, w_sh, slot, warp_step(j + stages, wk, wks), tile, wk, tx, g, q)
                load(w, x, w_cur, x_reg, 0, d, warp_step(j + xr, wk, wks), tile, g, q, col, batch,
                     False, True)  # fmt: skip

    accumulate_gpu = accumulate_smem if cfg.w_smem else accumulate_regs

    @T.macro
    def accumulate_cpu(w, x, acc, wk, tile, tx, col, batch):
        # what the warp's mma leave in this lane's accumulators, computed from memory
        base = (wk * 32 + tx) * n_acc
        for j in T.serial(per_warp):
            ks: T.let[T.int32] = warp_step(j, wk, wks)
            if ks < n_steps:
                for m in T.serial(mt):
                    for t in T.serial(nt):
                        for e in T.serial(4):
                            er, ec = T.meta_var(acc_coords(tx, e))
                            row: T.let[T.int32] = weight_row(tile * rb + m * 16 + er)
                            b: T.let[T.int32] = T.min(x_row(col, t, ec), batch - 1)
                            i: T.let[T.int32] = base + acc_index(m, t, e, nt)
                            for kk in T.serial(step):
                                if in_k(ks * step + kk):
                                    acc[i] = acc[i] + T.Cast("float32", w[row, ks * step + kk]) \
                                        * T.Cast("float32", x[b, ks * step + kk])  # fmt: skip

    @T.macro
    def to_part(acc, base, part, wk, tx, t):
        for m in T.unroll(mt):
            for e in T.unroll(4):
                er, ec = T.meta_var(acc_coords(tx, e))
                part[wk, ec, m * 16 + er] = acc[base + acc_index(m, t, e, nt)]

    @T.macro
    def prefetch_weights(w, tile, wk, tx):
        # the first steps' weight lines into L2 while the producer of X still runs: the weight
        # is constant, so this may precede the wait (schedules/pdl.py)
        g, q = T.meta_var(lane_coords(tx))
        if q == 0:
            for j in T.unroll(prefetched):
                ks: T.let[T.int32] = warp_step(j, wk, wks)
                if ks < n_steps:
                    for h in T.unroll(2 * mt):
                        for c in T.unroll(lines):
                            T.evaluate(prefetch_l2(gpu, T.address_of(
                                w[weight_row(load_row(tile, h, g, mt)),
                                  T.min(ks * step + c * LINE, k - 1)])))  # fmt: skip

    @T.macro
    def finish(out, extras, acc, sq, early, part, sq_sh, wk, tx, tile, col, batch):
        # a tile's epilogue: the warps' sums (and squares) meet in shared memory, then stores
        if rms:  # a row's squares: over the 4 lanes that load it, then per warp
            g, q = T.meta_var(lane_coords(tx))
            for j in T.unroll(nt):
                for b in T.unroll(2):
                    sq[j] = sq[j] + T.tvm_warp_shuffle_xor(FULL_MASK, sq[j], 1 << b, 32, 32)
                if q == 0:
                    sq_sh[wk, j * TILE_COLS + g] = sq[j]
        for t in T.unroll(nt):
            to_part(acc, 0, part, wk, tx, t)
            T.tvm_storage_sync("shared")
            store(out, extras, part, wk, tx, tile, col, t, batch, sq_sh,
                  early if load_early is not None else None)  # fmt: skip
            if t + 1 < nt:
                T.tvm_storage_sync("shared")  # before the next n-tile's writes

    @T.macro
    def tile_gpu(x, w, out, extras, batch, tile, col, part, sq_sh):
        # one thread nest: the accumulators stay in registers while the n-tiles' sums go
        # through `part` one n-tile at a time (8 KB at most, whatever the batch)
        for wk in warps():
            for tx in lanes():
                with T.sblock("accumulate"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                    # the folded norm's: each row's squares
                    sq = T.sblock_alloc_buffer((nt,), "float32", scope="local")
                    # the epilogue's extras (a residual), read now rather than after the stream
                    early = T.sblock_alloc_buffer((max(early_size, 1),), "float32", scope="local")
                    if dependent:
                        prefetch_weights(w, tile, wk, tx)
                        T.evaluate(wait_for_producers(gpu))
                        T.evaluate(release_dependents(gpu))
                    if load_early is not None:
                        load_early(extras, early, wk, tx, tile, col, batch)
                    for i in T.unroll(n_acc):
                        acc[i] = T.float32(0)
                    for j in T.unroll(nt):
                        sq[j] = T.float32(0)
                    accumulate_gpu(w, x, acc, wk, tile, tx, col, batch, sq)
                    if cfg.w_smem:  # `part` may reuse the ring's memory: every warp done with it
                        T.tvm_storage_sync("shared")
                    finish(out, extras, acc, sq, early, part, sq_sh, wk, tx, tile, col, batch)

    # sm_90's persistent blocks through the bulk ring (schedules/gemv_bulk.py)
    parts = BodyParts(load, product, accumulate_regs, finish, load_early, early_size, warps, lanes)
    # a residual's or SwiGLU's GEMV feeds a GEMV (the next norm-folded projection, down)
    release_early = load_early is not None or pair is not None
    tiles_bulk = bulk_nest(k, cfg, tiles, grid, weight_row, parts, release_early) if bulk else None

    @T.macro
    def squares_cpu(x, sq_sh, wk, tx, col, batch):
        # each lane's squares of the X it loads (the GPU's maps), summed over a row's 4 lanes
        g, q = T.meta_var(lane_coords(tx))
        for j in T.serial(nt):
            if q == 0:
                sq_sh[wk, j * TILE_COLS + g] = T.float32(0)
            for jj in T.serial(per_warp):
                ks: T.let[T.int32] = warp_step(jj, wk, wks)
                for u in T.serial(unroll):
                    for e in T.serial(VEC):
                        kk: T.let[T.int32] = load_k(ks, u, q, step) + e
                        if ks < n_steps and kk < k:
                            # inline, not let-bound: TVM's CPU bf16 legalisation would read a
                            # let's bf16 bits as an integer
                            xv = T.meta_var(
                                T.Cast("float32", x[T.min(x_row(col, j, g), batch - 1), kk])
                            )
                            sq_sh[wk, j * TILE_COLS + g] = sq_sh[wk, j * TILE_COLS + g] + xv * xv

    @T.macro
    def tile_cpu(x, w, out, extras, batch, tile, col, part, sq_sh):
        # the same phases as separate loop nests (a nest is a barrier); accumulators in memory
        acc = T.sblock_alloc_buffer((wks * 32 * n_acc,), "float32", scope="global")
        for wk in warps():
            for tx in lanes():
                for i in T.serial(n_acc):
                    acc[(wk * 32 + tx) * n_acc + i] = T.float32(0)
                accumulate_cpu(w, x, acc, wk, tile, tx, col, batch)
                if rms:
                    squares_cpu(x, sq_sh, wk, tx, col, batch)
        for t in T.serial(nt):
            for wk in warps():
                for tx in lanes():
                    to_part(acc, (wk * 32 + tx) * n_acc, part, wk, tx, t)
            for wk in warps():
                for tx in lanes():
                    with T.sblock("store"):
                        T.reads()
                        T.writes()
                        store(out, extras, part, wk, tx, tile, col, t, batch, sq_sh, None)

    tile_body = tile_gpu if gpu else tile_cpu

    part_scope = "shared" if gpu else "global"
    sq_shape = (wks, cols) if rms else (1, 1)

    @T.macro
    def launch(x, w, out, extras, batch):
        # batches past cols take more blocks (a loop would let nvcc keep the first loads live)
        for p in passes(T.ceildiv(batch, cols)):
            for tile in blocks(grid):
                with T.sblock("tile"):
                    T.reads()
                    T.writes()
                    if gpu:
                        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", min_blocks)
                    # each warp's partial sums of one n-tile, [warp, batch column, row]
                    part = T.sblock_alloc_buffer((wks, TILE_COLS, rb), "float32", scope=part_scope)
                    # each warp's squares of each row of the pass (RMSNorm'd X only)
                    sq_sh = T.sblock_alloc_buffer(sq_shape, "float32", scope=part_scope)
                    if bulk:  # `tile` is a persistent block here
                        ring = T.sblock_alloc_buffer((bulk_ring_elems(cfg),), DTYPE,
                                                     scope="shared.dyn")  # fmt: skip
                        bars = T.sblock_alloc_buffer((2 * stages,), "uint64", scope="shared")
                        tiles_bulk(x, w, out, extras, batch, tile, p * cols, part, sq_sh, ring,
                                   bars)  # fmt: skip
                    else:
                        tile_body(x, w, out, extras, batch, tile, p * cols, part, sq_sh)

    return launch
