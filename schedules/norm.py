"""RMSNorm over the last axis, in float32, reading and writing the activation dtype.

One kernel where Relax's `rms_norm` legalises to two or three (a cast to float32, the norm,
the cast back): a decode step runs 65 of them, each mostly latency. A block per row, a
thread per 128-bit vector of it: each thread sums its squares, threads of a second phase add
GROUP of those sums each, and every thread adds theirs and scales its vector (two barriers;
the halving-stride reduction this replaced took eight more).

A decoder layer's two norms have no weight here (`weighted=False`): each feeds one projection,
and conversion folds HF's (1 + w) into that projection's columns (compile/convert.py), so what
is left is the scale 1 / rms, which decode's GEMVs apply themselves (compile/norm_fusion.py).
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

MAX_THREADS = 1024
GROUP = 16  # partial sums a thread of the second phase adds
EPS_ATTR = "qwen35.rms_norm_eps"  # on the kernel: compile/norm_fusion.py finds norms by it


def rms_norm(dim: int, eps: float, dtype: str, target: Target, weighted: bool = True) -> PrimFunc:
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, over rows of `dim` values:
    (x [rows, dim] dtype, weight [dim] float32) -> out [rows, dim] dtype; without `weighted`
    (x, out) and no weight."""
    gpu = target.kind.name == "cuda"
    # 128-bit loads: a thread a vector, so a 2,560-wide bf16 row is 320 threads on the GPU
    vec = 8 if dtype == "bfloat16" else 4
    vec = vec if dim % vec == 0 else 1
    chunks = dim // vec
    # the CPU runs the same lanes one phase at a time, so its tests check the GPU's indexing
    nt = min(MAX_THREADS, -(-chunks // 32) * 32)
    per_thread = -(-chunks // nt)
    groups = -(-nt // GROUP)
    shared = "shared" if gpu else "global"
    # staged in the activation dtype on the GPU (whole vectors), in float32 on the CPU (TVM's
    # CPU bf16 legalisation rejects local bf16 buffers)
    stage = dtype if gpu else "float32"

    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

    def weight_of(w, c):
        return w[c] if weighted else T.float32(1)

    @T.macro
    def body(x, w, out, rows):
        for r in grid(rows):
            with T.sblock("row"):
                T.reads()
                T.writes()
                # two phases of partial sums (a thread's, then GROUP of them), two barriers
                part = T.sblock_alloc_buffer((nt,), "float32", scope=shared)
                part2 = T.sblock_alloc_buffer((groups,), "float32", scope=shared)
                for tx in lanes():
                    with T.sblock("squares"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        vals = T.sblock_alloc_buffer((vec,), stage, scope="local")
                        T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                        T.evaluate(release_dependents(gpu))
                        acc[0] = T.float32(0)
                        for e in T.serial(per_thread):
                            if e * nt + tx < chunks:
                                for v in T.vectorized(vec):
                                    vals[v] = T.Cast(stage, x[r, (e * nt + tx) * vec + v])
                                for v in T.unroll(vec):
                                    acc[0] = acc[0] + T.Cast("float32", vals[v]) * T.Cast(
                                        "float32", vals[v]
                                    )
                        part[tx] = acc[0]
                for tx in lanes():
                    with T.sblock("groups"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        if tx < groups:
                            acc[0] = T.float32(0)
                            # every groups-th sum: consecutive lanes, consecutive banks
                            for p in T.unroll(GROUP):
                                if p * groups + tx < nt:
                                    acc[0] = acc[0] + part[p * groups + tx]
                            part2[tx] = acc[0]
                for tx in lanes():
                    with T.sblock("scale"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        vals = T.sblock_alloc_buffer((vec,), stage, scope="local")
                        res = T.sblock_alloc_buffer((vec,), stage, scope="local")
                        acc[0] = T.float32(0)
                        for g in T.serial(groups):
                            acc[0] = acc[0] + part2[g]
                        inv: T.let[T.float32] = T.rsqrt(acc[0] / T.float32(dim) + T.float32(eps))
                        for e in T.serial(per_thread):
                            c: T.let[T.int32] = (e * nt + tx) * vec
                            if e * nt + tx < chunks:
                                for v in T.vectorized(vec):
                                    vals[v] = T.Cast(stage, x[r, c + v])
                                for v in T.unroll(vec):
                                    scaled = T.meta_var(T.Cast("float32", vals[v]) * inv)
                                    res[v] = T.Cast(stage, scaled * weight_of(w, c + v))
                                for v in T.vectorized(vec):
                                    out[r, c + v] = T.Cast(dtype, res[v])

    if weighted:

        @T.prim_func(s_tir=True)
        def rms_norm_rows(x_h: T.handle, w_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            rows = T.int32()
            x = T.match_buffer(x_h, (rows, dim), dtype)
            w = T.match_buffer(w_h, (dim,), "float32")
            out = T.match_buffer(out_h, (rows, dim), dtype)
            body(x, w, out, rows)

        func = rms_norm_rows
    else:

        @T.prim_func(s_tir=True)
        def rms_scale_rows(x_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            rows = T.int32()
            x = T.match_buffer(x_h, (rows, dim), dtype)
            out = T.match_buffer(out_h, (rows, dim), dtype)
            body(x, x, out, rows)  # no weight: `w` is never read

        func = rms_scale_rows
    # names must differ in a module, which holds one kernel for each width, dtype and eps
    named = func.with_attr("global_symbol", kernel_name(dim, eps, dtype, weighted))
    return named.with_attr(EPS_ATTR, float(eps))


def kernel_name(dim: int, eps: float, dtype: str, weighted: bool = True) -> str:
    kind = "rms_norm" if weighted else "rms_scale"
    return f"{kind}_{dtype}_{dim}_eps{eps:.6e}".replace(".", "p").replace("-", "m")
