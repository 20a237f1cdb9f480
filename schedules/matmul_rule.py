"""The pipeline's rule for prefill's and decode_wide's GEMMs: a fused bf16 GEMM PrimFunc
(gemm_match.py) becomes the tensor-core kernel of schedules/matmul.py, with the sm_90a wgmma
path of schedules/matmul_wgmma.py for prefill's tiles."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from .gemm_match import match_gemm
from .matmul import gemm_kernel
from .matmul_config import ROWS_ATTR, GemmConfig, default_config, has_tensor_cores
from .matmul_wgmma import BLOCK_K, SM80_SHARED_BYTES, WgmmaConfig, default_wgmma_config
from .split_k import MIN_SPLITS, SMS, can_split

# column tiles whose mma.sync launch (shared_launch_config) tiles into warps, widest first
SMALL_M_WIDTHS = (256, 192, 160, 128, 96, 64)
# whether the pipeline's GEMMs launch small_m_config's tiling for one m tile. H200, 4B
# (docs/results/small_m_h200_s48/): a mixed step of 16 rows + 112 tokens 6,259 -> 6,031 us (qkv
# 41.0 -> 25.6 us a call, in_proj 31.4 -> 28.2, gate_up unchanged), a 100-token prompt's TTFT
# 5.13 -> 4.97 ms (medians of 6), greedy tokens identical
SMALL_M_TILING = True


def shared_launch_config(wgmma: WgmmaConfig) -> GemmConfig:
    """The mma.sync tiling that shares `wgmma`'s launch (128 x block_n, 8 warps), for the
    arches without wgmma; 3 stages keep it within sm_80's 163 KB."""
    warps_m = 2 if wgmma.block_n % 64 == 0 else 4
    return GemmConfig(
        block_n=wgmma.block_n,
        block_k=BLOCK_K,
        warps_m=warps_m,
        warps_n=8 // warps_m,
        pair_store=True,
        frag_pipeline=True,
    )


def small_m_config(n: int, k: int, wgmma: WgmmaConfig, min_splits: int) -> WgmmaConfig | None:
    """The tiling an m of one tile (a short prompt, a mixed step) launches instead of `wgmma`:
    there the weight is the one large operand, so the GEMM streams it as fast as its tiles keep
    SMs busy. Where `wgmma`'s column tiles leave over a quarter of the SMs idle and split-K does
    not fill them, the widest tile that fills 3/4 to all of them in one wave, its ring 4 stages
    deep (3 where sm_80's launch would not hold 4); None where none does or none is needed.
    H200 (session 48): qkv and in_proj gained, gate_up's 96 -> 116 CTAs changed nothing."""
    tiles = -(-n // wgmma.block_n)
    if tiles >= 3 * SMS // 4 or can_split(tiles, k // BLOCK_K, min_splits) or wgmma.ctas:
        return None
    for width in SMALL_M_WIDTHS:
        if 3 * SMS // 4 <= -(-n // width) <= SMS:
            deep = replace(wgmma, block_n=width, stages=4)
            return deep if deep.shared_bytes <= SM80_SHARED_BYTES else replace(deep, stages=3)
    return None


def gemm_for(
    func: tirx.PrimFunc,
    config: GemmConfig | None = None,
    wgmma: WgmmaConfig | Literal["default"] | None = None,
    swiglu: bool = False,
    split_k: bool = True,
    min_splits: int = MIN_SPLITS,
    small_m: bool = SMALL_M_TILING,
) -> tirx.PrimFunc | None:
    """The tensor-core kernel standing in for `func`, parameters in `func`'s order; None if
    `func` is not a fused bf16 GEMM this kernel covers. Without `config`, `default_config`.
    With `wgmma` ("default": `default_wgmma_config`), sm_90a runs wgmma and the other arches
    `shared_launch_config` (k a multiple of 64; else `config` alone). With `swiglu`, `func` is a
    gate_up projection without extra inputs and the kernel stores the SwiGLU of its output,
    [m, n / 2] (gemm_kernel's `swiglu`). `split_k`: gemm_kernel's (off for the benchmark's
    before-and-after rows); with `small_m` and the default wgmma tiling, an m of one tile
    launches `small_m_config`'s where it gives one."""
    match = match_gemm(func)
    if match is None or swiglu and (match.extra_shapes or match.n % 2):
        return None
    small = None
    if wgmma is not None and match.k % BLOCK_K == 0:
        if wgmma == "default":
            wgmma = default_wgmma_config(match.n)
            small = small_m_config(match.n, match.k, wgmma, min_splits) if small_m else None
        config = config or shared_launch_config(wgmma)
    else:
        wgmma = None
    config = config or default_config(match.n)
    if match.k % config.block_k and match.k % 32 == 0:
        config = replace(config, block_k=32)  # small k (tiny configs): the 32-deep tile
    if match.k % config.block_k:
        return None
    kernel = gemm_kernel(
        match.n,
        match.k,
        config,
        match.extra_shapes,
        match.extra_dtypes,
        match.out_dtype,
        match.epilogue,
        wgmma,
        swiglu,
        split_k,
        min_splits,
        small and (shared_launch_config(small), small),
    )
    # the kernel's own order is (A, B, *extras, out); put each where `func` has it
    order = [match.a_param, match.b_param, *match.extra_params, match.out_param]
    params = [None] * len(order)
    for kernel_pos, func_pos in enumerate(order):
        params[func_pos] = kernel.params[kernel_pos]
    out = tirx.PrimFunc(params, kernel.body, attrs=kernel.attrs)
    for key, value in (func.attrs or {}).items():
        if key not in kernel.attrs:
            out = out.with_attr(key, value)
    return out


class MatmulMMA(GPUScheduleRule):
    """dlight rule: the fused bf16 GEMMs the pipeline marked with `rows` ("large": prefill,
    "wide": wide decode) become the tensor-core kernel on sm_80+; everything else falls through
    to the next rule."""

    def __init__(self, config: GemmConfig | None = None, rows: str = "large"):
        if config is not None:
            config.check()
        self.config = config
        self.rows = rows

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if not has_tensor_cores(target) or func.attrs is None:
            return None
        if func.attrs.get(ROWS_ATTR) != self.rows:
            return None
        # prefill's tiles carry an sm_90a path; decode_wide's 64-row ones do not
        dual = self.rows == "large" and self.config is None
        kernel = gemm_for(func, self.config, "default" if dual else None)
        return None if kernel is None else s_tir.Schedule(kernel)
