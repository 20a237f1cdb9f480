"""Tensor-core GEMM for the bf16 projections of prefill: C = epilogue(A · Bᵀ), A [m, k] bf16 with
m symbolic, B [n, k] bf16 (the weight as stored, k contiguous), fp32 accumulation on
mma.sync m16n8k16, then whatever elementwise epilogue FuseOps put behind the matmul (the cast to
bf16, a residual add, ...), evaluated on the accumulator in registers.

Why our own kernel: dlight's tensor-core path (`gpu.Matmul` -> `MatmulTensorization`) needs
`Schedule.tensorize`, which deep-copies the intrinsic through TVM's JSON serializer, and with the
installed apache-tvm-ffi (0.1.15) that serializer segfaults on any node with a dtype field
(`tvm.ir.save_json(tvm.tirx.IntImm("int32", 3))` is enough); apache-tvm 0.27.0.post1 works with
apache-tvm-ffi 0.1.14.post0. TVM's mma/wmma intrinsics are fp16/int8-only anyway. So, like
schedules/logits.py, this kernel is plain TIR with the PTX instructions written out, and it
replaces the fused PrimFunc whole (`MatmulMMA` in matmul_rule.py, a dlight rule).

Kernel: a thread block computes a block_m x block_n tile of C with warps_m x warps_n warps, each
owning a (block_m / warps_m) x (block_n / warps_n) sub-tile. k is consumed block_k at a time
through a `stages`-deep ring of shared-memory tiles filled by cp.async (16-byte chunks, each
tile row's chunks XOR-swizzled so ldmatrix and the copies are bank-conflict free); ldmatrix.x4
moves 16x16 A and 16(n)x16(k) B fragments to registers, mma.sync accumulates in fp32. Rows of A
past m (and of B past n) are clamped to the last row: they only feed accumulator rows (columns)
that are never stored. The grid runs m tiles fastest, so the blocks in flight share weight tiles
through L2 and the weight is streamed from DRAM about once.

Prefill's kernels also carry an sm_90a path on wgmma (schedules/matmul_wgmma.py), chosen per
arch by nvcc; this mma.sync path then takes an 8-warp tiling of the same launch
(matmul_rule.shared_launch_config). A SwiGLU epilogue (`swiglu`) stores silu(gate) · up of a
gate_up weight's two halves, each B tile holding its columns' gate and up rows.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .gemm_layout import (
    acc_coords,
    copy_coords,
    ldmatrix_a_coords,
    ldmatrix_b_coords,
    paired_weight_row,
    tile_offset,
)
from .gemm_match import DTYPE, Epilogue, fused_gemm_func, plain_epilogue
from .matmul_config import DEFAULT_CONFIG, GemmConfig
from .matmul_wgmma import (
    BLOCK_K,
    BLOCK_M,
    THREADS,
    WgmmaConfig,
    pair_store,
    tensor_maps,
    wgmma_tile,
)
from .pdl import release_dependents, wait_for_producers
from .ptx import cp_async_16, is_sm90a, ldmatrix_x4, mma_bf16
from .split_k import (
    can_split,
    k_range,
    partial_store,
    reduce_partials,
    split_count,
    workspace_elems,
)

# ---- the kernel ----------------------------------------------------------------------------


def gemm_kernel(
    n: int,
    k: int,
    config: GemmConfig = DEFAULT_CONFIG,
    extra_shapes: tuple[str, ...] = (),
    extra_dtypes: tuple[str, ...] = (),
    out_dtype: str = "float32",
    epilogue: Epilogue = plain_epilogue,
    wgmma: WgmmaConfig | None = None,
    swiglu: bool = False,
    split_k: bool = True,
) -> tirx.PrimFunc:
    """The kernel with parameters (A [m, k], B [n, k], *extras, out [m, n]); each extra input
    is indexed [m, n], [n] or [m] (`extra_shapes` "mn", "n", "m"). `epilogue(acc, row, col,
    extras)` gives the value stored at out[row, col] from the fp32 accumulator.

    With `wgmma`, the code nvcc builds for sm_90a computes the same tiles with wgmma
    (schedules/matmul_wgmma.py): `config` must then tile like it (128 x wgmma.block_n, 8 warps,
    k a multiple of 64), since the two paths share one launch.

    With `swiglu`, B is a gate_up weight [n = 2 inter, k] and out [m, inter] takes
    silu(gate) · up of the epilogue's values (rounded as the SwiGLU kernel rounds them): each
    block's B tile pairs its output columns' gate and up rows (gemm_layout.paired_weight_row).
    With `wgmma` and `split_k`, an m whose tiles leave SMs idle splits k (schedules/split_k.py)."""
    config.check()
    if swiglu and (extra_shapes or n % 2 or wgmma is not None and not wgmma.tma):
        raise ValueError("a SwiGLU epilogue takes no extra inputs, an even n and TMA on sm_90a")
    if wgmma is not None and (
        (config.block_m, config.block_n, config.threads) != (BLOCK_M, wgmma.block_n, THREADS)
        or k % BLOCK_K
    ):
        raise ValueError(f"{config} and {wgmma} do not share a launch (or k {k} % {BLOCK_K})")
    if k % config.block_k:
        raise ValueError(f"k {k} must be a multiple of block_k {config.block_k}")
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.stages
    wn_count, threads = config.warps_n, config.threads
    warp_m, warp_n = bm // config.warps_m, bn // config.warps_n
    mt_count, nt_count = warp_m // 16, warp_n // 8  # m16 and n8 tiles per warp
    ksteps = bk // 16
    chunks = bk // 8
    a_copies, b_copies = bm * chunks // threads, bn * chunks // threads
    k_tiles, n_tiles = k // bk, -(-n // bn)
    inter = n // 2
    n_out = inter if swiglu else n
    smem_bytes = max(config.shared_bytes, wgmma.shared_bytes if wgmma else 0)
    smem_elems = smem_bytes // 2
    b_at = stages * bm * bk  # B's ring follows A's
    scope = "shared" if smem_bytes <= 48 * 1024 else "shared.dyn"
    pair = config.pair_store and n_out % 2 == 0  # c even and n even: c + 1 < n too
    store = pair_store(epilogue, out_dtype if swiglu else None)
    store_partial = partial_store(n, swiglu)
    if wgmma is not None:
        sm90_tile = wgmma_tile(n, k, wgmma, epilogue, n_out % 2 == 0, swiglu, out_dtype)
        maps, encode = tensor_maps(k, wgmma, swiglu)
    # Prefill's (dual-path) GEMMs launch early and wait for their producer on the SMs it
    # frees; decode_wide's start after it, as its GEMVs do (launched early, those one-wave
    # kernels ran 1.3-1.5x slower: docs/performance.md).
    dependent = wgmma is not None
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
                        if kt + stages - 1 < kc:
                            load_tile(
                                a,
                                b,
                                smem,
                                (kt + stages - 1) % stages,
                                kt0 + kt + stages - 1,
                                bx,
                                by,
                                tid,
                                m,
                            )
                        T.evaluate(T.ptx["cp.async.commit_group"]())
                    mmas(a_frag, b_frag, acc, kk % 2)
            else:
                # tile kt has landed once at most stages - 2 groups are
                # pending; the barrier also retires the stage the next
                # copy overwrites
                T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
                T.tvm_storage_sync("shared")
                if kt + stages - 1 < kc:
                    load_tile(
                        a,
                        b,
                        smem,
                        (kt + stages - 1) % stages,
                        kt0 + kt + stages - 1,
                        bx,
                        by,
                        tid,
                        m,
                    )
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

    reduce = reduce_partials(n, n_out, swiglu, store)

    @T.macro
    def gemm_block(a, b, out, extras, m, bx, by, ty, tx, ws, z, splits):
        with T.sblock("gemm"):
            T.reads()
            T.writes()
            smem = T.sblock_alloc_buffer((smem_elems,), DTYPE, scope=scope)
            if dependent:
                T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                T.evaluate(release_dependents(True))
            if wgmma is None:
                tile(a, b, out, extras, m, smem, bx, by, ty, tx, ws, z, splits)
            elif is_sm90a():
                sm90_tile(a, b, out, extras, m, smem, bx, by, ty * 32 + tx, maps, ws, z, splits)
            else:
                tile(a, b, out, extras, m, smem, bx, by, ty, tx, ws, z, splits)

    @T.macro
    def grid(a, b, out, extras, m):
        for bx in T.thread_binding(T.ceildiv(m, bm), thread="blockIdx.x"):
            for by in T.thread_binding(n_tiles, thread="blockIdx.y"):
                for ty in T.thread_binding(threads // 32, thread="threadIdx.y"):
                    for tx in T.thread_binding(32, thread="threadIdx.x"):
                        gemm_block(a, b, out, extras, m, bx, by, ty, tx, None, 0, 1)

    @T.macro
    def split_grid(a, b, out, extras, m, ws, splits):
        for z in T.thread_binding(splits, thread="blockIdx.z"):
            for bx in T.thread_binding(T.ceildiv(m, bm), thread="blockIdx.x"):
                for by in T.thread_binding(n_tiles, thread="blockIdx.y"):
                    for ty in T.thread_binding(threads // 32, thread="threadIdx.y"):
                        for tx in T.thread_binding(32, thread="threadIdx.x"):
                            gemm_block(a, b, out, extras, m, bx, by, ty, tx, ws, z, splits)

    # prefill's GEMMs whose tiles can leave most SMs idle get a split-K launch beside the
    # plain one (split_k.py), chosen on the host by m
    splittable = dependent and split_k and can_split(n_tiles, k_tiles)

    @T.macro
    def body(a, b, out, extras, m):
        if wgmma is not None and wgmma.tma:
            encode(a, b, m, n)  # on the host, before the launch
        if splittable:
            splits = T.meta_var(split_count(m, bm, n_tiles, k_tiles))
            ws = T.alloc_buffer((workspace_elems(splits, m, n),), "float32")
            if splits > 1:
                split_grid(a, b, out, extras, m, ws, splits)
                reduce(out, extras, ws, m, splits, pair)
            else:
                grid(a, b, out, extras, m)
        else:
            grid(a, b, out, extras, m)

    @T.macro
    def body_persistent(a, b, out, extras, m):
        encode(a, b, m, n)  # on the host, before the launch
        for cta in T.thread_binding(wgmma.ctas, thread="blockIdx.x"):
            for ty in T.thread_binding(threads // 32, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("gemm"):
                        T.reads()
                        T.writes()
                        smem = T.sblock_alloc_buffer((smem_elems,), DTYPE, scope=scope)
                        T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                        T.evaluate(release_dependents(True))
                        if is_sm90a():
                            sm90_tile(a, b, out, extras, m, smem, cta, ty * 32 + tx, maps)
                        else:
                            # the same tiles, one after another; the barrier frees the ring
                            m_tiles: T.let[T.int32] = T.ceildiv(m, bm)
                            for t in T.serial(T.ceildiv(m_tiles * n_tiles, wgmma.ctas)):
                                idx: T.let[T.int32] = cta + t * wgmma.ctas
                                if idx < m_tiles * n_tiles:
                                    tile(a, b, out, extras, m, smem, idx % m_tiles,
                                         idx // m_tiles, ty, tx, None, 0, 1)  # fmt: skip
                                T.tvm_storage_sync("shared")

    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True}
    kernel = body_persistent if wgmma is not None and wgmma.ctas else body
    return fused_gemm_func(
        "gemm", kernel, n, k, extra_shapes, extra_dtypes, out_dtype, attrs, out_n=n_out
    )
