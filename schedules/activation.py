"""SwiGLU's activation: out = silu(gate) * up, from the fused gate_up projection's output
[tokens, 2 * inter] (gate first, then up), in float32, rounded once to the activation dtype.

Relax's split + silu + multiply fuses into one kernel too, but that kernel is TVM's: it cannot
take part in programmatic dependent launch (schedules/pdl.py), so it held the down projection
back behind its own launch in each of a decode step's 32 MLPs. Here each thread takes `vec`
consecutive columns (128-bit loads and stores where `inter` allows). Decode's gate_up GEMV
computes the same in its epilogue instead (`swiglu_of`, compile/swiglu_fusion.py).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .gdn_prep import rounded
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

GPU_THREADS = 256
NAME = "swiglu"
INTER_ATTR = "qwen35.swiglu_inter"  # on the kernel: compile/swiglu_fusion.py finds it by this


def silu_mul(gate: tirx.Expr, up: tirx.Expr) -> tirx.Expr:
    """silu(gate) · up of float32 values: this kernel's math and the fused GEMV's, written
    once so that both round alike."""
    return gate / (T.float32(1) + T.exp(-gate)) * up


def swiglu_of(gate: tirx.Expr, up: tirx.Expr, dtype: str, gpu: bool) -> tirx.Expr:
    """What the kernel stores for gate and up values as gate_up holds them (expressions of
    its dtype): silu_mul in float32, rounded once to `dtype`. On the CPU the values are rounded
    by hand: TVM's CPU bf16 legalisation drops a cast to bf16 and back (gdn_prep.rounded),
    where the kernel's gate_up went through memory."""

    def value(v: tirx.Expr) -> tirx.Expr:
        wide = T.Cast("float32", v)
        return wide if gpu else rounded(wide, str(v.ty))

    return T.Cast(dtype, silu_mul(value(gate), value(up)))


def swiglu(inter: int, dtype: str, target: Target) -> PrimFunc:
    """(gate_up [n_tok, 2 * inter] dtype) -> out [n_tok, inter] dtype."""
    gpu = target.kind.name == "cuda"
    nt = GPU_THREADS if gpu else 1
    vec = 8 if inter % 8 == 0 and dtype == "bfloat16" else (4 if inter % 4 == 0 else 1)
    per_row = inter // vec
    # staged in the activation dtype on the GPU (whole 128-bit vectors), in float32 on the CPU
    # (TVM's CPU bf16 legalisation rejects local bf16 buffers)
    stage = dtype if gpu else "float32"
    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

    @T.prim_func(s_tir=True)
    def swiglu_fn(x_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok = T.int32()
        x = T.match_buffer(x_h, (n_tok, 2 * inter), dtype)
        out = T.match_buffer(out_h, (n_tok, inter), dtype)
        for blk in grid((n_tok * per_row + nt - 1) // nt):
            for tx in lanes():
                with T.sblock("swiglu"):
                    T.reads()
                    T.writes()
                    # raw values in, rounded values out, whole vectors each way; the math
                    # between them is scalar (TVM has no 8-wide float32 vector type)
                    gate = T.sblock_alloc_buffer((vec,), stage, scope="local")
                    up = T.sblock_alloc_buffer((vec,), stage, scope="local")
                    res = T.sblock_alloc_buffer((vec,), stage, scope="local")
                    T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                    T.evaluate(release_dependents(gpu))
                    i: T.let[T.int32] = blk * nt + tx
                    if i < n_tok * per_row:
                        row: T.let[T.int32] = i // per_row
                        c: T.let[T.int32] = i % per_row * vec
                        for v in T.vectorized(vec):
                            gate[v] = T.Cast(stage, x[row, c + v])
                        for v in T.vectorized(vec):
                            up[v] = T.Cast(stage, x[row, inter + c + v])
                        for v in T.unroll(vec):
                            g: T.let[T.float32] = T.Cast("float32", gate[v])
                            res[v] = T.Cast(stage, silu_mul(g, T.Cast("float32", up[v])))
                        for v in T.vectorized(vec):
                            out[row, c + v] = T.Cast(dtype, res[v])

    return swiglu_fn.with_attr("global_symbol", f"{NAME}_{dtype}_{inter}").with_attr(
        INTER_ATTR, inter
    )
