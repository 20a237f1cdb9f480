"""RMSNorm over the last axis, in float32, reading and writing the activation dtype.

One kernel where Relax's `rms_norm` legalises to two or three (a cast to float32, the norm,
the cast back): a decode step runs 65 of them, each mostly launch latency. A block per row:
each thread sums the squares of a strided share of the row, the block adds the shares in
shared memory by halving strides, and every thread scales its share.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

GPU_THREADS = 256


def rms_norm(dim: int, eps: float, dtype: str, target: Target) -> PrimFunc:
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, over rows of `dim` values:
    (x [rows, dim] dtype, weight [dim] float32) -> out [rows, dim] dtype."""
    gpu = target.kind.name == "cuda"
    nt = min(GPU_THREADS, 1 << max(0, (dim - 1).bit_length())) if gpu else 1
    steps = nt.bit_length() - 1
    shared = "shared" if gpu else "global"

    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

    @T.prim_func(s_tir=True)
    def rms_norm_rows(x_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        rows = T.int32()
        x = T.match_buffer(x_h, (rows, dim), dtype)
        w = T.match_buffer(w_h, (dim,), "float32")
        out = T.match_buffer(out_h, (rows, dim), dtype)
        for r in grid(rows):
            with T.sblock("row"):
                T.reads()
                T.writes()
                # ping-pong rows: step s reads row s % 2, each lane writes its own slot of the
                # other, so no lane reads what another writes
                sums = T.sblock_alloc_buffer((2, nt), "float32", scope=shared)
                for tx in lanes():
                    with T.sblock("squares"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        T.evaluate(wait_for_producers(gpu))
                        T.evaluate(release_dependents(gpu))
                        acc[0] = T.float32(0)
                        for e in T.serial((dim + nt - 1) // nt):
                            if e * nt + tx < dim:
                                # no let: TVM's bf16 legalization on the CPU mistypes a let
                                # bound to a cast of a bf16 load
                                acc[0] = acc[0] + T.Cast("float32", x[r, e * nt + tx]) * T.Cast(
                                    "float32", x[r, e * nt + tx]
                                )
                        sums[0, tx] = acc[0]
                for s in T.serial(steps):
                    for tx in lanes():
                        with T.sblock("reduce"):
                            T.reads()
                            T.writes()
                            o: T.let[T.int32] = T.min(tx + T.shift_right(nt, s + 1), nt - 1)
                            sums[1 - s % 2, tx] = sums[s % 2, tx] + sums[s % 2, o]
                for tx in lanes():
                    with T.sblock("scale"):
                        T.reads()
                        T.writes()
                        inv: T.let[T.float32] = T.rsqrt(
                            sums[steps % 2, 0] / T.float32(dim) + T.float32(eps)
                        )
                        for e in T.serial((dim + nt - 1) // nt):
                            c: T.let[T.int32] = e * nt + tx
                            if c < dim:
                                out[r, c] = T.Cast(dtype, T.Cast("float32", x[r, c]) * inv * w[c])

    # names must differ in a module, which holds one kernel for each width, dtype and eps
    return rms_norm_rows.with_attr("global_symbol", kernel_name(dim, eps, dtype))


def kernel_name(dim: int, eps: float, dtype: str) -> str:
    return f"rms_norm_{dtype}_{dim}_eps{eps:.6e}".replace(".", "p").replace("-", "m")
