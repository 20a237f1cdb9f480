"""sm_80's path of prefill's GEMM (schedules/matmul.py): the tile a block computes with
mma.sync m16n8k16, fp32 accumulation, then the fused epilogue on the accumulator in registers.

A block computes a block_m x block_n tile of C with warps_m x warps_n warps, each owning a
(block_m / warps_m) x (block_n / warps_n) sub-tile. k is consumed block_k at a time through a
`stages`-deep ring of shared-memory tiles filled by cp.async (16-byte chunks, each tile row's
chunks XOR-swizzled so ldmatrix and the copies are bank-conflict free); ldmatrix.x4 moves 16x16
A and 16(n)x16(k) B fragments to registers, mma.sync accumulates in fp32. Rows of A past m (and
of B past n) are clamped to the last row: they only feed accumulator rows (columns) that are
never stored.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .gemm_layout import (
    acc_coords,
    copy_coords,
    ldmatrix_a_coords,
    ldmatrix_b_coords,
    paired_weight_row,
    tile_offset,
)
from .gemm_match import DTYPE
from .matmul_config import GemmConfig
from .ptx import cp_async_16, ldmatrix_x4, mma_bf16
from .split_k import k_range


def mma_sync_tile(n: int, k: int, config: GemmConfig, swiglu: bool, store, store_partial):
    """A macro (a, b, out, extras, m, smem, bx, by, ty, tx, ws, z, splits) computing tile
    (bx, by) of out = A · Bᵀ through the epilogue's `store` (split z of `splits` > 1: its fp32
    partial through `store_partial`, split_k.py); its ring in `smem`, a bf16 shared buffer of
    at least config.shared_bytes. With `swiglu`, each B tile holds its columns' gate and up
    rows (gemm_layout.paired_weight_row) and out takes silu(gate) · up, [m, n / 2]."""
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.stages
    wn_count, threads = config.warps_n, config.threads
    warp_m, warp_n = bm // config.warps_m, bn // config.warps_n
    mt_count, nt_count = warp_m // 16, warp_n // 8  # m16 and n8 tiles per warp
    ksteps = bk // 16
    chunks = bk // 8
    a_copies, b_copies = bm * chunks // threads, bn * chunks // threads
    k_tiles = k // bk
    inter = n // 2
    n_out = inter if swiglu else n
    b_at = stages * bm * bk  # B's ring follows A's
    pair = config.pair_store and n_out % 2 == 0  # c even and n even: c + 1 < n too
    frag_pipe = config.frag_pipeline
    frag_sets = 2 if frag_pipe else ksteps

    def b_row(row, by):
        # a SwiGLU pairs gate and up rows within each warp's columns
        if swiglu:
            return paired_weight_row(row, warp_n, by * (bn // 2), inter)
        return by * bn + row

    out_tiles = nt_count // 2 if swiglu else nt_count

    def out_col(by, col_w):
        return by * (bn // 2) + col_w // 2 if swiglu else by * bn + col_w

    @T.macro
    def load_tile(a, b, smem, stage, kt, bx, by, tid, m):
        # rows past m / n are clamped: they feed only accumulators that are never stored
        for it in T.unroll(a_copies):
            row, chunk = T.meta_var(copy_coords(it * threads + tid, chunks))
            at = T.meta_var(stage * bm * bk + tile_offset(row, chunk, chunks))
            from_at = T.meta_var(T.min(bx * bm + row, m - 1) * k + kt * bk + chunk * 8)
            T.evaluate(cp_async_16(smem.data, at, a.data, from_at))
        for it in T.unroll(b_copies):
            row, chunk = T.meta_var(copy_coords(it * threads + tid, chunks))
            at = T.meta_var(b_at + stage * bn * bk + tile_offset(row, chunk, chunks))
            from_at = T.meta_var(T.min(b_row(row, by), n - 1) * k + kt * bk + chunk * 8)
            T.evaluate(cp_async_16(smem.data, at, b.data, from_at))

    @T.macro
    def refill(a, b, smem, kt, kt0, kc, bx, by, tid, m):
        # the ring's tile stages - 1 ahead of tile kt, into the stage it will occupy
        if kt + stages - 1 < kc:
            load_tile(a, b, smem, (kt + stages - 1) % stages, kt0 + kt + stages - 1, bx, by, tid, m)

    @T.macro
    def load_frags(a_frag, b_frag, smem, slot, stage, kk, tx, row_w, col_w):
        # k16 step kk of a stage's tiles into fragment set `slot`
        for mt in T.unroll(mt_count):
            ar, ac = T.meta_var(ldmatrix_a_coords(tx, kk))
            T.evaluate(
                ldmatrix_x4(
                    a_frag,
                    (slot * mt_count + mt) * 8,
                    smem,
                    stage * bm * bk + tile_offset(row_w + mt * 16 + ar, ac, chunks),
                )
            )
        for np in T.unroll(nt_count // 2):
            br, bc = T.meta_var(ldmatrix_b_coords(tx, kk))
            T.evaluate(
                ldmatrix_x4(
                    b_frag,
                    (slot * nt_count + np * 2) * 4,
                    smem,
                    b_at + stage * bn * bk + tile_offset(col_w + np * 16 + br, bc, chunks),
                )
            )

    @T.macro
    def mmas(a_frag, b_frag, acc, slot):
        for mt in T.unroll(mt_count):
            for nt in T.unroll(nt_count):
                T.evaluate(
                    mma_bf16(
                        a_frag.data,
                        (slot * mt_count + mt) * 8,
                        b_frag.data,
                        (slot * nt_count + nt) * 4,
                        acc.data,
                        (mt * nt_count + nt) * 4,
                    )
                )

    @T.macro
    def tile(a, b, out, extras, m, smem, bx, by, ty, tx, ws, z, splits):
        # one fragment set per k16 step (frag_pipe: two, alternating), so the next step's
        # ldmatrix can be issued while this step's mma run; split z of `splits` (split_k.py)
        # takes k tiles [kt0, kt0 + kc) and stores its partial into ws
        kt0, kc = T.meta_var(k_range(z, splits, k_tiles))
        a_frag = T.alloc_local((frag_sets * mt_count * 8,), DTYPE)
        b_frag = T.alloc_local((frag_sets * nt_count * 4,), DTYPE)
        acc = T.alloc_local((mt_count * nt_count * 4,), "float32")
        tid: T.let[T.int32] = ty * 32 + tx
        row_w: T.let[T.int32] = ty // wn_count * warp_m
        col_w: T.let[T.int32] = ty % wn_count * warp_n
        for i in T.unroll(mt_count * nt_count * 4):
            acc[i] = T.float32(0)
        for s in T.unroll(stages - 1):
            if s < kc:
                load_tile(a, b, smem, s, kt0 + s, bx, by, tid, m)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        if frag_pipe:
            # tile 0 landed; its first fragments
            T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
            T.tvm_storage_sync("shared")
            load_frags(a_frag, b_frag, smem, 0, 0, 0, tx, row_w, col_w)
        for kt in T.serial(kc):
            stage: T.let[T.int32] = kt % stages
            if frag_pipe:
                for kk in T.unroll(ksteps):
                    if kk == ksteps - 1:
                        # tile kt + 1 landed, and every warp has its last
                        # fragments of tile kt (the copy at kk 0 of tile
                        # kt + 1 overwrites stage kt)
                        T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
                        T.tvm_storage_sync("shared")
                    # the next k16 step's fragments (the next tile's first
                    # at the last step) load while this step's mma run
                    if kk < ksteps - 1:
                        load_frags(
                            a_frag,
                            b_frag,
                            smem,
                            (kk + 1) % 2,
                            stage,
                            kk + 1,
                            tx,
                            row_w,
                            col_w,
                        )
                    elif kt + 1 < kc:
                        load_frags(
                            a_frag,
                            b_frag,
                            smem,
                            0,
                            (kt + 1) % stages,
                            0,
                            tx,
                            row_w,
                            col_w,
                        )
                    if kk == 0:
                        # into stage kt - 1, retired at the last barrier
                        refill(a, b, smem, kt, kt0, kc, bx, by, tid, m)
                        T.evaluate(T.ptx["cp.async.commit_group"]())
                    mmas(a_frag, b_frag, acc, kk % 2)
            else:
                # tile kt has landed once at most stages - 2 groups are
                # pending; the barrier also retires the stage the next
                # copy overwrites
                T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
                T.tvm_storage_sync("shared")
                refill(a, b, smem, kt, kt0, kc, bx, by, tid, m)
                T.evaluate(T.ptx["cp.async.commit_group"]())
                for kk in T.unroll(ksteps):
                    load_frags(
                        a_frag,
                        b_frag,
                        smem,
                        kk,
                        stage,
                        kk,
                        tx,
                        row_w,
                        col_w,
                    )
                    mmas(a_frag, b_frag, acc, kk)
        # with a SwiGLU, a warp's n8 tiles nt and nt + out_tiles hold gate and up of a column
        for mt in T.unroll(mt_count):
            for nt in T.unroll(out_tiles):
                for eh in T.unroll(2):
                    # acc e = 2 eh + v: row half eh, column pair v
                    er, ec = T.meta_var(acc_coords(tx, eh * 2))
                    r: T.let[T.int32] = bx * bm + row_w + mt * 16 + er
                    c: T.let[T.int32] = out_col(by, col_w) + nt * 8 + ec
                    a_at: T.let[T.int32] = (mt * nt_count + nt) * 4 + eh * 2
                    up_at = T.meta_var(a_at + out_tiles * 4)
                    if splits == 1:
                        store(out, extras, acc, a_at, up_at, r, c, m, n_out, pair)
                    else:
                        store_partial(ws, acc, a_at, up_at, z, r, c, m, n_out)

    return tile
