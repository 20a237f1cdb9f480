"""The sm_90a path of the prefill GEMM (schedules/matmul.py): the same C = epilogue(A · Bᵀ) tile
of 128 rows x block_n columns, computed by wgmma instead of mma.sync.

Two warpgroups each own 64 rows of the tile and issue wgmma.mma_async m64n{block_n}k16 straight
from shared memory, with fp32 accumulators in registers (block_n / 2 a thread). k is consumed 64
at a time through a `stages`-deep ring of shared-memory tiles: a tile row is 64 bf16 = 128
bytes, its 16-byte chunks XOR-swizzled by the row's place among 8 (the 128-byte swizzle that
wgmma's descriptors and TMA name), each tile 1,024-byte aligned.

The ring is filled one of two ways (`WgmmaConfig.tma`):
- TMA (the default tilings): the host encodes A's and B's tensor maps before the launch;
  thread 0 loads a stage as two (A, B) boxes on the stage's full mbarrier and refills it once
  every thread has arrived on its empty mbarrier, after the wgmma that read it. `stages` - 1
  tiles load ahead; no block barrier runs per k tile.
- cp.async: every thread copies its chunks; at tile kt a thread waits for its own wgmma group
  kt - 1 only, and a stage is refilled two tiles after the group that read it (a block barrier
  apart), so `stages` - 2 tiles load ahead.

With a SwiGLU epilogue (gate_up weights, TMA only) B is loaded as two half boxes, the tile's
columns' gate rows then their up rows, so each lane holds both halves of its columns.

Where nvcc compiles for another arch the branch that calls this is dead code (ptx.is_sm90a), so
one kernel carries both paths and each GPU runs its own.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .activation import swiglu_of
from .gemm_layout import acc_coords, copy_coords, tile_offset
from .gemm_match import DTYPE, Epilogue
from .pdl import release_dependents, wait_for_producers
from .ptx import cp_async_16, wgmma_bf16, wgmma_desc_sw128
from .split_k import k_range, partial_store
from .wgmma_config import (  # noqa: F401  (re-exported: the tilings live beside the kernel)
    ALIGN,
    BLOCK_K,
    BLOCK_M,
    ROW_BYTES,
    SM80_SHARED_BYTES,
    SM90_SHARED_BYTES,
    THREADS,
    WgmmaConfig,
    default_wgmma_config,
)


def pair_store(epilogue: Epilogue, swiglu_dtype: str | None):
    """A macro storing one lane's column pair, acc[at : at + 2], at out[r, c : c + 2] through
    the epilogue (`pair`: as one vector); with `swiglu_dtype`, silu(gate) · up of the pair at
    `at` (gate) and at `up_at`, rounded as the SwiGLU kernel rounds it. Both GEMM paths'."""

    def value(acc, at, up_at, r, c, extras):
        if swiglu_dtype is None:
            return epilogue(acc[at], r, c, extras)
        gate, up = epilogue(acc[at], r, c, extras), epilogue(acc[up_at], r, c, extras)
        return swiglu_of(gate, up, swiglu_dtype, gpu=True)

    @T.macro
    def store(out, extras, acc, at, up_at, r, c, m, n, pair):
        if pair:
            if r < m and c < n:
                for v in T.vectorized(2):
                    out[r, c + v] = value(acc, at + v, up_at + v, r, c + v, extras)
        else:
            for v in T.unroll(2):
                if r < m and c + v < n:
                    out[r, c + v] = value(acc, at + v, up_at + v, r, c + v, extras)

    return store


def tensor_maps(k: int, cfg: WgmmaConfig, swiglu: bool = False, a_halves: bool = False):
    """The TMA descriptors of A [m, k] and B [n, k] (a stage's box each, 128-byte swizzle, rows
    past the end read as zeros; with `swiglu`, B's box is half a tile, loaded twice: the gate
    rows, then their up rows; with `a_halves`, so is A's: wgmma_tile's `a_pair`), and a macro
    `encode(a, b, m, n)` that encodes them on the host before the launch (TVM passes them to
    the kernel as parameters); m and n may be dynamic."""
    maps = tuple(T.Var(f"{name}_tensormap", T.handle("tensormap").ty) for name in ("a", "b"))

    @T.macro
    def encode_one(tmap, src, rows, box):
        T.Bind(T.tvm_stack_alloca("tensormap", 1), var=tmap)
        T.evaluate(
            T.tensormap_encode_tiled(
                tmap,
                src.data,
                k,
                rows,
                k * 2,
                BLOCK_K,
                box,
                1,
                1,
                descriptor_dtype=DTYPE,
                rank=2,
                swizzle=3,  # CU_TENSOR_MAP_SWIZZLE_128B
            )
        )

    @T.macro
    def encode(a, b, m, n):
        encode_one(maps[0], a, m, BLOCK_M // 2 if a_halves else BLOCK_M)
        encode_one(maps[1], b, n, cfg.block_n // 2 if swiglu else cfg.block_n)

    return maps, encode


def wgmma_tile(
    n: int,
    k: int,
    cfg: WgmmaConfig,
    epilogue: Epilogue,
    pair: bool,
    swiglu: bool = False,
    out_dtype: str = DTYPE,
    accumulate_only: bool = False,
    a_pair: int = 0,
    stage_hook=None,
    early_a: bool = False,
):
    """A macro computing the tile (bx, by) with THREADS threads (`tid`), its ring in `smem` (a
    bf16 shared buffer of at least cfg.shared_bytes). Rows of A past m (B past n) are clamped
    to the last row: they feed only accumulators that are never stored. With `accumulate_only`,
    the macro `accumulate(a, b, acc, m, smem, bx, by, tid, maps, state, kt0, kc)` instead:
    the tile's k tiles [kt0, kt0 + kc) into a thread's bn / 2 fp32 `acc` (zeroed first;
    wgmma's D layout), for an epilogue of the caller's own.

    For the swapped GEMMs whose A is a weight (accumulate_only, TMA): with `a_pair`, A's tile
    is two boxes of 64 rows, bx * 64 and `a_pair` rows further (a SwiGLU's gate rows and their
    up rows), the first warpgroup's and the second's; `stage_hook(smem, at, tid, state)` runs
    in every thread once a stage has landed, `at` its B tile's first element, `state` what
    the caller passed `accumulate`. With `early_a`, the ring's first A tiles load before the
    kernel waits for its producer, which the macro does (and releases its dependents); the
    caller must not wait before it."""
    cfg.check()
    if (a_pair or stage_hook is not None or early_a) and not (accumulate_only and cfg.tma):
        raise ValueError(f"{cfg}: a_pair, stage_hook, early_a: for accumulate_only with TMA")
    bn, stages = cfg.block_n, cfg.stages
    chunks = BLOCK_K // 8
    a_copies, b_copies = BLOCK_M * chunks // THREADS, bn * chunks // THREADS
    k_tiles = k // BLOCK_K
    stage_elems = cfg.stage_bytes // 2
    if swiglu and (not cfg.tma or bn % 16):
        raise ValueError(f"{cfg}: a SwiGLU epilogue needs TMA and block_n a multiple of 16")
    inter = n // 2
    n_out, out_tiles = (inter, bn // 16) if swiglu else (n, bn // 8)
    b_boxes, b_box = (2, bn // 2) if swiglu else (1, bn)  # B's TMA boxes a stage, their rows
    a_boxes, a_box = (2, BLOCK_M // 2) if a_pair else (1, BLOCK_M)
    store = pair_store(epilogue, out_dtype if swiglu else None)
    store_partial = partial_store(n, swiglu)
    b_at = BLOCK_M * BLOCK_K  # elements from a stage's start to its B tile
    ahead = stages - 2
    n_tiles = -(-n // bn)

    def bar(smem, bar0, i):
        return T.address_of(smem[bar0 + i * 4])  # mbarrier i: 8 bytes, 4 bf16

    def persistent_step(g, cta, m_tiles):
        """(kt, bx, by) of a persistent CTA's ring step g."""
        idx = cta + g // k_tiles * cfg.ctas
        return g % k_tiles, idx % m_tiles, idx // m_tiles

    @T.macro
    def copy_rows(smem, dst, src, copies, src_row, kt, tid):
        for it in T.unroll(copies):
            row, chunk = T.meta_var(copy_coords(it * THREADS + tid, chunks))
            at = T.meta_var(dst + tile_offset(row, chunk, chunks))
            from_at = T.meta_var(src_row(row) * k + kt * BLOCK_K + chunk * 8)
            T.evaluate(cp_async_16(smem.data, at, src.data, from_at))

    @T.macro
    def load(a, b, smem, pad, s, kt, bx, by, tid, m):
        a_row = T.meta_var(lambda row: T.min(bx * BLOCK_M + row, m - 1))
        copy_rows(smem, pad + s * stage_elems, a, a_copies, a_row, kt, tid)
        b_row = T.meta_var(lambda row: T.min(by * bn + row, n - 1))
        copy_rows(smem, pad + s * stage_elems + b_at, b, b_copies, b_row, kt, tid)

    @T.macro
    def mma_stage(acc, stage, wg):
        T.evaluate(T.ptx.wgmma.fence.sync.aligned())
        for kk in T.unroll(BLOCK_K // 16):
            T.evaluate(
                wgmma_bf16(
                    acc,
                    wgmma_desc_sw128(stage + T.uint32(wg * 64 * ROW_BYTES + kk * 32)),
                    wgmma_desc_sw128(stage + T.uint32(BLOCK_M * ROW_BYTES + kk * 32)),
                    bn,
                )
            )
        T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())

    @T.macro
    def mainloop_cp_async(a, b, acc, m, smem, pad, ring, bx, by, tid, kt0, kc):
        for s in T.unroll(ahead):
            if s < kc:
                load(a, b, smem, pad, s, kt0 + s, bx, by, tid, m)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for kt in T.serial(kc):
            # tile kt has landed once `ahead` - 1 newer groups may still be pending; the
            # barrier also retires stage kt - 2, whose wgmma every thread waited for at kt - 1
            T.evaluate(T.ptx["cp.async.wait_group"](ahead - 1))
            T.evaluate(T.ptx.fence.proxy.async_.shared__cta())  # cp.async writes -> wgmma reads
            T.tvm_storage_sync("shared.dyn")
            if kt + ahead < kc:
                load(a, b, smem, pad, (kt + ahead) % stages, kt0 + kt + ahead, bx, by, tid, m)
            T.evaluate(T.ptx["cp.async.commit_group"]())
            mma_stage(acc, ring + T.Cast("uint32", kt % stages * cfg.stage_bytes), tid // 128)
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(1))

    @T.macro
    def tma_a(maps, smem, pad, bars, s, kt, bx):
        # thread 0: the stage's full barrier expects its bytes (B's too), then A's boxes
        T.evaluate(T.ptx.mbarrier.arrive.expect_tx.shared.b64(bars(s), T.uint32(cfg.stage_bytes)))
        for half in T.unroll(a_boxes):
            T.evaluate(
                T.ptx[
                    "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                ](
                    T.address_of(smem[pad + s * stage_elems + half * a_box * BLOCK_K]),
                    T.address_of(maps[0]),
                    kt * BLOCK_K,
                    bx * a_box + half * a_pair,
                    bars(s),
                )
            )

    @T.macro
    def tma_b(maps, smem, pad, bars, s, kt, by):
        for half in T.unroll(b_boxes):
            T.evaluate(
                T.ptx[
                    "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                ](
                    T.address_of(smem[pad + s * stage_elems + b_at + half * b_box * BLOCK_K]),
                    T.address_of(maps[1]),
                    kt * BLOCK_K,
                    # a SwiGLU's tile: its columns' gate rows, then their up rows
                    by * b_box + half * inter,
                    bars(s),
                )
            )

    @T.macro
    def tma_stage(maps, smem, pad, bars, s, kt, bx, by):
        tma_a(maps, smem, pad, bars, s, kt, bx)
        tma_b(maps, smem, pad, bars, s, kt, by)

    @T.macro
    def init_barriers(smem, bar0, tid):
        # after the ring: full[s] (thread 0 arrives, TMA completes its bytes), then empty[s]
        # (every thread arrives once its wgmma of the stage is done)
        if tid == 0:
            for s in T.unroll(stages):
                T.evaluate(T.ptx.mbarrier.init.shared.b64(bar(smem, bar0, s), T.uint32(1)))
                T.evaluate(
                    T.ptx.mbarrier.init.shared.b64(bar(smem, bar0, stages + s), T.uint32(THREADS))
                )
            # TMA (the async proxy) completes bytes on these barriers: the PTX memory model
            # wants their init made visible to it, as gemv_bulk's ring does
            T.evaluate(T.ptx.fence.mbarrier_init.release.cluster())
            T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
        T.tvm_storage_sync("shared.dyn")

    @T.macro
    def step_tma(maps, acc, smem, pad, ring, bar0, tid, g, iters, at, state):
        # ring step g: wait for its stage, issue its wgmma, then release step g - 1's stage,
        # which thread 0 refills with step g - 1 + stages (`at(step)`: its (kt, bx, by))
        T.evaluate(T.cuda.mbarrier_wait(bar(smem, bar0, g % stages), g // stages % 2))
        if stage_hook is not None:
            stage_hook(smem, pad + g % stages * stage_elems + b_at, tid, state)
        mma_stage(acc, ring + T.Cast("uint32", g % stages * cfg.stage_bytes), tid // 128)
        T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(1))
        if g > 0:
            done: T.let[T.int32] = g - 1
            empty = T.meta_var(bar(smem, bar0, stages + done % stages))
            T.evaluate(T.ptx.mbarrier.arrive.shared.b64(empty, T.uint32(1)))
            if tid == 0 and done + stages < iters:
                T.evaluate(T.cuda.mbarrier_wait(empty, done // stages % 2))
                kt, bx, by = T.meta_var(at(done + stages))
                full = T.meta_var(lambda s: bar(smem, bar0, s))
                tma_stage(maps, smem, pad, full, done % stages, kt, bx, by)

    @T.macro
    def fill_ring(maps, smem, pad, bar0, tid, iters, at):
        # the barriers, then thread 0 loads the ring's first `stages` steps
        init_barriers(smem, bar0, tid)
        full = T.meta_var(lambda s: bar(smem, bar0, s))
        if tid == 0:
            for s in T.unroll(stages):
                if s < iters:
                    kt, bx, by = T.meta_var(at(s))
                    if early_a:
                        tma_a(maps, smem, pad, full, s, kt, bx)
                    else:
                        tma_stage(maps, smem, pad, full, s, kt, bx, by)
        if early_a:
            # A (a weight) is constant: its first stages load while the producer of B still
            # runs; B's after the wait (schedules/pdl.py)
            T.evaluate(wait_for_producers(True))
            T.evaluate(release_dependents(True))
            if tid == 0:
                for s in T.unroll(stages):
                    if s < iters:
                        kt, bx, by = T.meta_var(at(s))
                        tma_b(maps, smem, pad, full, s, kt, by)

    @T.macro
    def mainloop_tma(maps, acc, smem, pad, ring, bx, by, tid, kt0, kc, state):
        bar0: T.let[T.int32] = pad + stages * stage_elems
        at = T.meta_var(lambda g: (kt0 + g, bx, by))
        fill_ring(maps, smem, pad, bar0, tid, kc, at)
        for kt in T.serial(kc):
            step_tma(maps, acc, smem, pad, ring, bar0, tid, kt, kc, at, state)

    @T.macro
    def store_tile(out, extras, acc, m, bx, by, tid, ws, z, splits):
        T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        # wgmma's accumulator layout is mma.sync's m16n8 one, a 16-row slab per warp; with a
        # SwiGLU, n8 tiles nt and nt + out_tiles hold gate and up of the same columns
        for nt in T.unroll(out_tiles):
            for eh in T.unroll(2):
                er, ec = T.meta_var(acc_coords(tid % 32, eh * 2))
                r: T.let[T.int32] = bx * BLOCK_M + tid // 32 * 16 + er
                c: T.let[T.int32] = by * b_box + nt * 8 + ec
                at: T.let[T.int32] = nt * 4 + eh * 2
                if splits == 1:
                    store(out, extras, acc, at, at + out_tiles * 4, r, c, m, n_out, pair)
                else:
                    store_partial(ws, acc, at, at + out_tiles * 4, z, r, c, m, n_out)

    @T.macro
    def accumulate_range(a, b, acc, m, smem, bx, by, tid, maps, kt0, kc, state):
        base: T.let[T.uint32] = T.cuda.cvta_generic_to_shared(smem.data)
        pad_bytes: T.let[T.uint32] = (T.uint32(ALIGN) - base % T.uint32(ALIGN)) % T.uint32(ALIGN)
        pad: T.let[T.int32] = T.Cast("int32", pad_bytes) // 2
        ring: T.let[T.uint32] = base + pad_bytes
        for i in T.unroll(bn // 2):
            acc[i] = T.float32(0)
        if cfg.tma:
            mainloop_tma(maps, acc, smem, pad, ring, bx, by, tid, kt0, kc, state)
        else:
            mainloop_cp_async(a, b, acc, m, smem, pad, ring, bx, by, tid, kt0, kc)

    @T.macro
    def tile(a, b, out, extras, m, smem, bx, by, tid, maps, ws, z, splits):
        # split z of `splits` (split_k.py): k tiles [kt0, kt0 + kc), its partial into ws
        kt0, kc = T.meta_var(k_range(z, splits, k_tiles))
        acc = T.alloc_local((bn // 2,), "float32")
        accumulate_range(a, b, acc, m, smem, bx, by, tid, maps, kt0, kc, None)
        store_tile(out, extras, acc, m, bx, by, tid, ws, z, splits)

    @T.macro
    def accumulate(a, b, acc, m, smem, bx, by, tid, maps, state, kt0, kc):
        accumulate_range(a, b, acc, m, smem, bx, by, tid, maps, kt0, kc, state)
        T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))

    @T.macro
    def tiles(a, b, out, extras, m, smem, cta, tid, maps):
        # persistent: this CTA's tiles are cta, cta + ctas, ... (m fastest); the ring's steps
        # run across them, so thread 0 loads the next tile's first stages during an epilogue
        acc = T.alloc_local((bn // 2,), "float32")
        base: T.let[T.uint32] = T.cuda.cvta_generic_to_shared(smem.data)
        pad_bytes: T.let[T.uint32] = (T.uint32(ALIGN) - base % T.uint32(ALIGN)) % T.uint32(ALIGN)
        pad: T.let[T.int32] = T.Cast("int32", pad_bytes) // 2
        ring: T.let[T.uint32] = base + pad_bytes
        m_tiles: T.let[T.int32] = T.ceildiv(m, BLOCK_M)
        mine: T.let[T.int32] = T.max(T.ceildiv(m_tiles * n_tiles - cta, cfg.ctas), 0)
        iters: T.let[T.int32] = mine * k_tiles
        at = T.meta_var(lambda g: persistent_step(g, cta, m_tiles))
        bar0: T.let[T.int32] = pad + stages * stage_elems
        fill_ring(maps, smem, pad, bar0, tid, iters, at)
        for g in T.serial(iters):
            if g % k_tiles == 0:
                for i in T.unroll(bn // 2):
                    acc[i] = T.float32(0)
            step_tma(maps, acc, smem, pad, ring, bar0, tid, g, iters, at, None)
            if g % k_tiles == k_tiles - 1:
                _, bx, by = T.meta_var(at(g))
                store_tile(out, extras, acc, m, bx, by, tid, None, 0, 1)

    if accumulate_only:
        return accumulate
    return tiles if cfg.ctas else tile
