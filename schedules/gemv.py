"""Decode GEMV for batches of 1-64: out = epilogue(X · Wᵀ), X [batch, k] bf16 (batch symbolic),
W [n, k] bf16 as stored, fp32 accumulation, then the elementwise epilogue gemm_match extracted
(the cast to bf16, a residual add, an activation, ...). The kernel of one config:
gemv_body.py, its rows and epilogue store: gemv_store.py; configs: gemv_config.py; index maps:
gemv_layout.py; the pipeline's rule: gemv_rule.py.

A decode step is a weight stream: every weight element is read once and applied to all rows
of the batch. On the GPU the product runs on mma.sync m16n8k16 with the weight as A (16 rows a
tile) and the batch as B (n-tiles of 8 columns, rows past the batch clamped, their outputs never
stored): each weight fragment meets every n-tile of the pass (1 for decode's 1-7 rows, up to 8
for decode_wide's 64), so the weight is read once per 64 rows. Each lane issues 128-bit loads
of 8 consecutive k of a weight row and the same 8 k of X; mma sums over k in any order, so the
physical k a lane loads are mapped to mma's logical k (`frag_source`), as in
schedules/logits.py. Lanes q = 0..3 of a row read 64 contiguous bytes per load instruction.

Split-K inside the block: a block owns 16 * m_tiles weight rows and its `warps_k` warps take
interleaved k steps of those rows, each keeping `stages` steps of weight loads in flight: in a
register ring (decode), or, where 64 columns' X and accumulators need the registers
(decode_wide), in a ring of shared memory filled by cp.async, a slot per lane's 16 bytes, so a
lane reads back only what it copied and no barrier is needed. X takes a ring of registers
(`x_stages`). The warps' partial sums meet in shared memory, an n-tile at a time, and the block
sums them and applies the epilogue: no workspace, no second pass. decode_wide's kernel holds
one launch per batch bucket (8, 16, 32, 64 rows a pass), picked on the host by the batch.

On sm_90 a config may take the bulk ring instead (`bulk`, schedules/gemv_bulk.py): a
persistent grid whose blocks' thread 0 keeps stages of the block's rows in shared memory by
cp.async.bulk, the first ones issued before the dependent wait; the lanes read from a stage
what they would have loaded, so the fragments, X's ring and the sums stay as above.

Decode's RMSNorm before a projection can be folded in (`rms_eps`, compile/norm_fusion.py):
each lane also sums the squares of the X it loads; the warps' squares meet in shared memory
beside the partial sums, and the epilogue scales each row's sum by its 1/rms. The norm has no
weight here: conversion folded it into W's columns (compile/convert.py), so X feeds mma as
loaded and the fold costs a lane only its squares' registers.

Decode's SwiGLU after the gate_up projection can be folded in too (`swiglu`,
compile/swiglu_fusion.py): each m16 tile takes the gate rows of 8 output columns and their up
rows (gemv_layout.paired_row; the weight stays [gate; up]), and the epilogue stores
silu(gate) · up, so gate_up never reaches memory. decode_wide folds its SwiGLU too, and its
norms where compile/norm_fusion.py's FOLD_WIDE says so.

The CPU variant is the same loop nest, except that a lane computes its accumulators from
memory instead of from mma fragments: CPU tests check every index but the data movement, which
tests/test_gemv_emulated.py checks by emulating the rings and mma in numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import tirx
from tvm.target import Target

from .activation import swiglu_of
from .gemm_match import Epilogue, by_rows, fused_gemm_func, plain_epilogue
from .gemv_body import pass_kernel
from .gemv_config import VEC, Buckets, GemvConfig, WideMmaConfig, default_config
from .gemv_wide_mma import wide_mma_launch

KERNEL_ATTR = "qwen35.kernel"  # set to "gemv" on the kernel, so tests can tell it is ours


def _dispatch(n: int, k: int, buckets: Buckets, gpu: bool, *fold):
    """A macro choosing, by the batch at run time, the kernel of the first bucket holding it
    (each bucket its own kernel, with its own registers and launch bounds). `fold`: the
    epilogue, rms_eps, pair and extra shapes of gemv_body.pass_kernel."""
    (limit, cfg), rest = buckets[0], buckets[1:]
    if isinstance(cfg, WideMmaConfig):
        epilogue, rms_eps, pair, _ = fold
        first = wide_mma_launch(n, k, cfg, gpu, epilogue, rms_eps, pair)
    else:
        first = pass_kernel(n, k, cfg, gpu, *fold)
    if not rest:
        return first
    return by_rows(limit, first, _dispatch(n, k, rest, gpu, *fold))


def gemv_kernel(
    n: int,
    k: int,
    target: Target,
    config: GemvConfig | Sequence[tuple[int, GemvConfig]] | None = None,
    extra_shapes: tuple[str, ...] = (),
    extra_dtypes: tuple[str, ...] = (),
    out_dtype: str = "float32",
    epilogue: Epilogue = plain_epilogue,
    rms_eps: float | None = None,
    swiglu: bool = False,
) -> tirx.PrimFunc:
    """The kernel with parameters (X [batch, k], W [n, k], *extras, out [batch, n]); extras are
    indexed [batch, n], [n] or [batch] (`extra_shapes` "mn", "n", "m"). `epilogue(acc,
    row, col, extras)` gives out[row, col] from the fp32 sum. `config`: one config, or buckets
    ((largest batch, config), ...) ascending, the last taking every larger batch too.

    `rms_eps`: X is the input of an RMSNorm without weight (its weight is in W's columns):
    out = epilogue(rsqrt(mean_k(X²) + eps) · Σ_k X · W), the norm folded in. Each block sums
    the squares of the X it loads anyway, so the norm costs no kernel and no pass over X of
    its own.

    `swiglu`: W is [gate; up] (n = 2 I) and out [batch, I] holds silu(gate) · up of the
    epilogue's values, in float32 rounded once to `out_dtype` (activation.swiglu_of), as the
    SwiGLU kernel computes from the stored gate_up."""
    config = config or default_config(n, k)
    buckets = (
        ((1 << 30, config),) if isinstance(config, (GemvConfig, WideMmaConfig)) else tuple(config)
    )
    if k % VEC:
        raise ValueError(f"k {k} must be a multiple of {VEC} (128-bit loads)")
    if swiglu and n % 2:
        raise ValueError(f"n {n} must be even with swiglu: gate and up rows")
    gpu = target.kind.name == "cuda"
    pair = (lambda gate, up: swiglu_of(gate, up, out_dtype, gpu)) if swiglu else None
    body = _dispatch(n, k, buckets, gpu, epilogue, rms_eps, pair, extra_shapes)
    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True, KERNEL_ATTR: "gemv"}
    return fused_gemm_func("gemv", body, n, k, extra_shapes, extra_dtypes, out_dtype, attrs,
                           n // 2 if swiglu else n)  # fmt: skip
