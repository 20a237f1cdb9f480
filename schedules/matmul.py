"""Tensor-core GEMM for the bf16 projections of prefill: C = epilogue(A · Bᵀ), A [m, k] bf16 with
m symbolic, B [n, k] bf16 (the weight as stored, k contiguous), fp32 accumulation, then whatever
elementwise epilogue FuseOps put behind the matmul (the cast to bf16, a residual add, ...),
evaluated on the accumulator in registers.

Why our own kernel: dlight's tensor-core path (`gpu.Matmul` -> `MatmulTensorization`) needs
`Schedule.tensorize`, which deep-copies the intrinsic through TVM's JSON serializer, and with the
installed apache-tvm-ffi (0.1.15) that serializer segfaults on any node with a dtype field
(`tvm.ir.save_json(tvm.tirx.IntImm("int32", 3))` is enough); apache-tvm 0.27.0.post1 works with
apache-tvm-ffi 0.1.14.post0. TVM's mma/wmma intrinsics are fp16/int8-only anyway. So, like
schedules/logits.py, this kernel is plain TIR with the PTX instructions written out, and it
replaces the fused PrimFunc whole (`MatmulMMA` in matmul_rule.py, a dlight rule).

A block computes one block_m x block_n tile of C; the grid runs m tiles fastest, so the blocks
in flight share weight tiles through L2 and the weight is streamed from DRAM about once.
Prefill's kernels run wgmma on sm_90a (schedules/matmul_wgmma.py), chosen per arch by nvcc;
other arches run mma.sync (schedules/matmul_mma_sync.py) on an 8-warp tiling of the same launch
(matmul_rule.shared_launch_config). A SwiGLU epilogue (`swiglu`) stores silu(gate) · up of a
gate_up weight's two halves, each B tile holding its columns' gate and up rows. An m of one tile
(a short prompt, a mixed step) may launch a tiling of its own (`small_m`), chosen on the host.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .gemm_match import DTYPE, Epilogue, by_rows, fused_gemm_func, plain_epilogue
from .matmul_config import DEFAULT_CONFIG, GemmConfig
from .matmul_mma_sync import mma_sync_tile
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
from .ptx import is_sm90a
from .split_k import (
    MIN_SPLITS,
    can_split,
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
    min_splits: int = MIN_SPLITS,
    small_m: tuple[GemmConfig, WgmmaConfig] | None = None,
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
    With `wgmma` and `split_k`, an m whose tiles leave SMs idle splits k (schedules/split_k.py)
    `min_splits` ways or more. `small_m` (with `wgmma`): the (mma.sync, wgmma) tiling of another
    launch, which an m of one tile (m <= BLOCK_M) takes instead, chosen on the host."""
    if swiglu and (extra_shapes or n % 2):
        raise ValueError("a SwiGLU epilogue takes no extra inputs and an even n")
    if small_m is not None and (wgmma is None or wgmma.ctas or small_m[1].ctas):
        raise ValueError(f"a small-m tiling {small_m} needs a non-persistent wgmma one")
    tiling = (n, k, epilogue, out_dtype, swiglu, split_k, min_splits)
    kernel = _launches(*tiling, config, wgmma)
    if small_m is not None:
        kernel = by_rows(BLOCK_M, _launches(*tiling, *small_m), kernel)

    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True}
    n_out = n // 2 if swiglu else n
    return fused_gemm_func(
        "gemm", kernel, n, k, extra_shapes, extra_dtypes, out_dtype, attrs, out_n=n_out
    )


def _launches(
    n: int,
    k: int,
    epilogue: Epilogue,
    out_dtype: str,
    swiglu: bool,
    split_k: bool,
    min_splits: int,
    config: GemmConfig,
    wgmma: WgmmaConfig | None,
):
    """A macro (a, b, out, extras, m) launching one tiling's kernels: the grid of tiles, or
    with split-K the split grid and its reduce kernel (both, chosen on the host by m)."""
    config.check()
    if swiglu and wgmma is not None and not wgmma.tma:
        raise ValueError("a SwiGLU epilogue takes TMA on sm_90a")
    if wgmma is not None and (
        (config.block_m, config.block_n, config.threads) != (BLOCK_M, wgmma.block_n, THREADS)
        or k % BLOCK_K
    ):
        raise ValueError(f"{config} and {wgmma} do not share a launch (or k {k} % {BLOCK_K})")
    if k % config.block_k:
        raise ValueError(f"k {k} must be a multiple of block_k {config.block_k}")
    bm, bn, threads = config.block_m, config.block_n, config.threads
    k_tiles, n_tiles = k // config.block_k, -(-n // bn)
    n_out = n // 2 if swiglu else n
    smem_bytes = max(config.shared_bytes, wgmma.shared_bytes if wgmma else 0)
    smem_elems = smem_bytes // 2
    scope = "shared" if smem_bytes <= 48 * 1024 else "shared.dyn"
    pair = config.pair_store and n_out % 2 == 0  # c even and n even: c + 1 < n too
    store = pair_store(epilogue, out_dtype if swiglu else None)
    tile = mma_sync_tile(n, k, config, swiglu, store, partial_store(n, swiglu))
    if wgmma is not None:
        sm90_tile = wgmma_tile(n, k, wgmma, epilogue, n_out % 2 == 0, swiglu, out_dtype)
        maps, encode = tensor_maps(k, wgmma, swiglu)
    # Prefill's (dual-path) GEMMs launch early and wait for their producer on the SMs it
    # frees; decode_wide's start after it, as its GEMVs do (launched early, those one-wave
    # kernels ran 1.3-1.5x slower: docs/performance.md).
    dependent = wgmma is not None

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
    splittable = dependent and split_k and can_split(n_tiles, k_tiles, min_splits)

    @T.macro
    def body(a, b, out, extras, m):
        if wgmma is not None and wgmma.tma:
            encode(a, b, m, n)  # on the host, before the launch
        if splittable:
            splits = T.meta_var(split_count(m, bm, n_tiles, k_tiles, min_splits))
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

    return body_persistent if wgmma is not None and wgmma.ctas else body
