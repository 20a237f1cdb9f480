"""The pipeline's side of the decode GEMV (schedules/gemv.py): which config a GEMM gets, the
kernel standing in for a fused GEMM with its parameters in place, and the dlight rule."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.target import Target

from .gemm_match import match_gemm
from .gemv import gemv_kernel
from .gemv_config import VEC, Buckets, GemvConfig, decode_bulk_config, default_config, wide_buckets
from .matmul_config import ROWS_ATTR, has_tensor_cores

# decode's 1-7 rows through sm_90's bulk ring where gemv_config.decode_bulk_config has a
# config (its sums run in another order than the register ring's, so greedy tokens differ
# from a library without it; they repeat run to run: docs/performance.md, session 37)
DECODE_BULK = True


def plan(n: int, k: int, rows: str) -> GemvConfig | Buckets:
    """The pipeline's choice for a GEMM of the row class `rows`: one config for decode's 1-7
    rows, buckets up to 64 columns a pass for decode_wide."""
    if rows == "wide":
        return wide_buckets(n, k)
    return (DECODE_BULK and decode_bulk_config(n, k)) or default_config(n, k)


def gemv_for(
    func: tirx.PrimFunc,
    target: Target,
    config: GemvConfig | Buckets | None = None,
    rows: str = "small",
    rms_eps: float | None = None,
    swiglu: bool = False,
) -> tirx.PrimFunc | None:
    """The GEMV standing in for the fused bf16 GEMM `func`, parameters in `func`'s order; None
    if `func` is not one this kernel covers. Without `config`, `plan(n, k, rows)`. With
    `rms_eps`, `func`'s A is the input of an RMSNorm without weight, folded into the kernel
    (gemv_kernel's `rms_eps`). With `swiglu`, the
    output is silu(gate) · up of `func`'s [gate | up] output (gemv_kernel's `swiglu`)."""
    match = match_gemm(func)
    if match is None or match.k % VEC:
        return None
    config = config or plan(match.n, match.k, rows)
    kernel = gemv_kernel(match.n, match.k, target, config, match.extra_shapes,
                         match.extra_dtypes, match.out_dtype, match.epilogue, rms_eps,
                         swiglu)  # fmt: skip
    # the kernel's own order is (X, W, *extras, out); put each where `func` has it
    order = [match.a_param, match.b_param, *match.extra_params, match.out_param]
    params = [None] * len(order)
    for kernel_pos, func_pos in enumerate(order):
        params[func_pos] = kernel.params[kernel_pos]
    out = tirx.PrimFunc(params, kernel.body, attrs=kernel.attrs)
    for key, value in (func.attrs or {}).items():
        if key not in kernel.attrs:
            out = out.with_attr(key, value)
    return out


class DecodeGemv(GPUScheduleRule):
    """dlight rule: the fused bf16 GEMMs the pipeline marked `rows` ("small": decode, 1-7 rows;
    "wide": decode_wide, 8-64) become this GEMV on sm_80+; anything else (fp32 GEMMs, k not a
    multiple of 8) falls through."""

    def __init__(self, config: GemvConfig | Buckets | None = None, rows: str = "small"):
        for cfg in [config] if isinstance(config, GemvConfig) else [c for _, c in config or ()]:
            cfg.check()
        self.config = config
        self.rows = rows

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if not has_tensor_cores(target) or func.attrs is None:
            return None
        if func.attrs.get(ROWS_ATTR) != self.rows:
            return None
        kernel = gemv_for(func, target, self.config, self.rows)
        return None if kernel is None else s_tir.Schedule(kernel)
