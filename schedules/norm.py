"""RMSNorm over the last axis, in float32, reading and writing the activation dtype.

One kernel where Relax's `rms_norm` legalises to two or three (a cast to float32, the norm,
the cast back). A warp per row, ROWS_A_BLOCK rows a block: each lane loads every 32nd
128-bit vector of its row and sums their squares; after the one barrier, each lane adds its
row's 32 sums and scales its vectors (loaded again, from L1). A lane issues all its loads
before it uses any: issued one after another, the ten of a 2,560-wide row took 15.5 us at
1,024 rows on the H200 (profile_step_s22.json), where a block a row of 320 threads and two
barriers took 5.3 us (profile_step_s20.json), its 1,024 blocks in 1.3 waves.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

ROWS_A_BLOCK = 4  # a warp a row
UNROLLED = 16  # vectors a lane loads at once at most (a 4,096-wide bf16 row: 16)
EPS_ATTR = "qwen35.rms_norm_eps"  # on the kernel: compile/norm_fusion.py finds norms by it


def rms_norm(dim: int, eps: float, dtype: str, target: Target) -> PrimFunc:
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, over rows of `dim` values:
    (x [rows, dim] dtype, weight [dim] float32) -> out [rows, dim] dtype."""
    gpu = target.kind.name == "cuda"
    vec = 8 if dtype == "bfloat16" else 4  # 128-bit loads
    vec = vec if dim % vec == 0 else 1
    chunks = dim // vec
    per = -(-chunks // 32)  # vectors a lane: lane, lane + 32, ...
    batch = min(per, UNROLLED)  # a lane's loads in flight: all of them, before any use
    rounds = -(-per // batch)
    nt = 32 * ROWS_A_BLOCK
    shared = "shared" if gpu else "global"
    # staged in the activation dtype on the GPU (whole vectors), in float32 on the CPU (TVM's
    # CPU bf16 legalisation rejects local bf16 buffers); the CPU runs the lanes one phase at a
    # time, so its tests check the GPU's indexing
    stage = dtype if gpu else "float32"

    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

    @T.macro
    def load(x, vals, r, rows, e0, tx):
        for u in T.unroll(batch):
            c: T.let[T.int32] = (e0 * batch + u) * 32 + tx % 32
            if r < rows and c < chunks:
                for v in T.vectorized(vec):
                    vals[u * vec + v] = T.Cast(stage, x[r, c * vec + v])

    @T.prim_func(s_tir=True)
    def rms_norm_rows(x_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        rows = T.int32()
        x = T.match_buffer(x_h, (rows, dim), dtype)
        w = T.match_buffer(w_h, (dim,), "float32")
        out = T.match_buffer(out_h, (rows, dim), dtype)
        for blk in grid((rows + ROWS_A_BLOCK - 1) // ROWS_A_BLOCK):
            with T.sblock("rows"):
                T.reads()
                T.writes()
                part = T.sblock_alloc_buffer((nt,), "float32", scope=shared)
                for tx in lanes():
                    with T.sblock("squares"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        vals = T.sblock_alloc_buffer((batch * vec,), stage, scope="local")
                        T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                        T.evaluate(release_dependents(gpu))
                        r: T.let[T.int32] = blk * ROWS_A_BLOCK + tx // 32
                        acc[0] = T.float32(0)
                        for e0 in T.serial(rounds):
                            load(x, vals, r, rows, e0, tx)
                            for u in T.unroll(batch):
                                if r < rows and (e0 * batch + u) * 32 + tx % 32 < chunks:
                                    for v in T.unroll(vec):
                                        acc[0] = acc[0] + T.Cast(
                                            "float32", vals[u * vec + v]
                                        ) * T.Cast("float32", vals[u * vec + v])
                        part[tx] = acc[0]
                for tx in lanes():
                    with T.sblock("scale"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        vals = T.sblock_alloc_buffer((batch * vec,), stage, scope="local")
                        res = T.sblock_alloc_buffer((vec,), stage, scope="local")
                        r: T.let[T.int32] = blk * ROWS_A_BLOCK + tx // 32
                        acc[0] = T.float32(0)
                        for p in T.unroll(32):
                            acc[0] = acc[0] + part[tx // 32 * 32 + p]
                        inv: T.let[T.float32] = T.rsqrt(acc[0] / T.float32(dim) + T.float32(eps))
                        for e0 in T.serial(rounds):
                            load(x, vals, r, rows, e0, tx)
                            for u in T.unroll(batch):
                                c: T.let[T.int32] = ((e0 * batch + u) * 32 + tx % 32) * vec
                                if r < rows and c < dim:
                                    for v in T.unroll(vec):
                                        res[v] = T.Cast(
                                            stage,
                                            T.Cast("float32", vals[u * vec + v]) * inv * w[c + v],
                                        )
                                    for v in T.vectorized(vec):
                                        out[r, c + v] = T.Cast(dtype, res[v])

    # names must differ in a module, which holds one kernel for each width, dtype and eps
    named = rms_norm_rows.with_attr("global_symbol", kernel_name(dim, eps, dtype))
    return named.with_attr(EPS_ATTR, float(eps))


def kernel_name(dim: int, eps: float, dtype: str) -> str:
    return f"rms_norm_{dtype}_{dim}_eps{eps:.6e}".replace(".", "p").replace("-", "m")
