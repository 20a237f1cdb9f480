"""(I + A)⁻¹ for every chunk of the chunked gated delta rule, ahead of its serial chunk loop.

In a chunk of C tokens of one sequence and value head, A[i, j] = β_i e^(G_i - G_j) (k_i · k_j)
for j < i and 0 elsewhere, with k rounded to bf16 as the tensor-core kernel rounds it and G the
chunk's cumulative log decay. T = (I + A)⁻¹ is unit lower triangular. With it the serial kernel
(gdn_chunked_mma's `wy`) gets U = T R by one matmul, where it otherwise solves (I + A) U = R 16
rows at a time: the WY form of fla's kernels. A and T do not depend on the state, so every
chunk of the prompt runs here at once.

Chunks are numbered sequence after sequence (kv_cache.first_tile), a block per (chunk number,
value head), which finds its sequence by binary search (kv_cache.seq_of_tile); numbers past a
sequence's chunks store nothing. T's rows are stored by token ([n_tok, v_heads, C], row i of
the chunk at its i-th token), so a sequence's last, partial chunk writes only its own rows.

A block: K's rows into shared memory (bf16), G by a running sum a thread, A a thread per entry,
then T a column a thread: each column is its own forward substitution of (I + A) t = e_j, in
registers (local memory), so no barrier sits inside it, and its rows go out as they stand, a
row of all columns at a time.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .gdn_prep import _rounded
from .kv_cache import first_tile, seq_of_tile
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

THREADS = 256
KPAD = 1  # K's shared row stride dk + 1: the threads of an entry row read distinct banks


def inverse_launch(
    k_heads: int, v_heads: int, dk: int, chunk: int, gpu: bool, threads: int | None = None
):
    """A macro (k, g, beta, indptr, tinv, n_seq, n_tok) launching the kernel: tinv[t, h, :]
    is row (t - chunk start) of its chunk's T for value head h, in bf16. `threads`: a block's
    (THREADS on the GPU; the CPU runs 1 unless a test asks for the GPU's layout)."""
    c, group = chunk, v_heads // k_heads
    nt = threads or (THREADS if gpu else 1)
    shared = "shared" if gpu else "global"
    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)
    dkp, cp = dk + KPAD, c + 1
    kdt = "bfloat16" if gpu else "float32"  # K's values are bf16; the CPU keeps them in fp32

    @T.macro
    def body(k, g, beta, indptr, tinv, n_seq, n_tok):
        for blk in grid((n_tok // c + n_seq) * v_heads):
            with T.sblock("chunk"):
                T.reads()
                T.writes()
                ks = T.sblock_alloc_buffer((c * dkp,), kdt, scope=shared)
                am = T.sblock_alloc_buffer((c * cp,), "float32", scope=shared)
                gs = T.sblock_alloc_buffer((c,), "float32", scope=shared)
                bs = T.sblock_alloc_buffer((c,), "float32", scope=shared)
                lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                num: T.let[T.int32] = blk // v_heads
                h: T.let[T.int32] = blk % v_heads
                seq_of_tile(indptr, n_seq, num, c, lo, hi)
                t0: T.let[T.int32] = indptr[lo[0]] + (num - first_tile(indptr, lo[0], c)) * c
                # nv <= 0: a number past the sequence's chunks. Its block still runs every
                # phase (a barrier may not sit in a condition) on clamped rows, storing nothing.
                nv: T.let[T.int32] = T.min(c, indptr[lo[0] + 1] - t0)
                t_end: T.let[T.int32] = T.min(t0 + T.max(nv, 1), n_tok) - 1  # a row to read
                for tx in lanes():
                    with T.sblock("load"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        for e in T.serial((c * dk + nt - 1) // nt):
                            x: T.let[T.int32] = e * nt + tx
                            r: T.let[T.int32] = x // dk
                            if x < c * dk:
                                val: T.let[T.float32] = k[
                                    T.min(t0 + r, t_end), h // group, x % dk
                                ]
                                ks[r * dkp + x % dk] = T.Cast(
                                    kdt, T.Select(r < nv, _rounded(val, "bfloat16"), T.float32(0))
                                )
                        for ii in T.serial((c + nt - 1) // nt):
                            i: T.let[T.int32] = ii * nt + tx
                            if i < c:  # G: the decays of this token and the ones before
                                run[0] = T.float32(0)
                                for j in T.serial(c):
                                    if j <= T.min(i, nv - 1):
                                        run[0] = run[0] + g[T.min(t0 + j, t_end), h]
                                gs[i] = run[0]
                                bs[i] = T.Select(
                                    i < nv, beta[T.min(t0 + i, t_end), h], T.float32(0)
                                )
                if gpu:  # explicit: the kernel may sit under a host-level `if`
                    T.tvm_storage_sync("shared")
                for tx in lanes():
                    with T.sblock("a"):
                        T.reads()
                        T.writes()
                        dot = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        for e in T.serial((c * c + nt - 1) // nt):
                            x: T.let[T.int32] = e * nt + tx
                            i: T.let[T.int32] = x // c
                            j: T.let[T.int32] = x % c
                            if x < c * c:
                                dot[0] = T.float32(0)
                                if j < i:
                                    for m in T.serial(dk):
                                        ki: T.let[T.float32] = T.Cast("float32", ks[i * dkp + m])
                                        kj: T.let[T.float32] = T.Cast("float32", ks[j * dkp + m])
                                        dot[0] = dot[0] + ki * kj
                                # min(., 0): the masked half never overflows
                                am[i * cp + j] = T.Select(
                                    j < i,
                                    bs[i] * T.exp(T.min(gs[i] - gs[j], T.float32(0))) * dot[0],
                                    T.float32(0),
                                )
                if gpu:
                    T.tvm_storage_sync("shared")
                for tx in lanes():
                    with T.sblock("solve"):
                        T.reads()
                        T.writes()
                        # the column in registers (local memory): shared is written once
                        col = T.sblock_alloc_buffer((c,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        for jj in T.serial((c + nt - 1) // nt):
                            j: T.let[T.int32] = jj * nt + tx
                            if j < c:
                                for r in T.serial(c):
                                    acc[0] = T.float32(0)
                                    for m in T.serial(r):
                                        acc[0] = acc[0] + am[r * cp + m] * col[m]
                                    col[r] = T.Select(
                                        r < j,
                                        T.float32(0),
                                        T.Select(r == j, T.float32(1), -acc[0]),
                                    )
                                # row r of every column at once: coalesced stores
                                for r in T.serial(c):
                                    if r < nv:
                                        tinv[t0 + r, h, j] = T.Cast("bfloat16", col[r])

    return body


def gdn_chunk_inverse(
    k_heads: int, v_heads: int, dk: int, chunk: int, target: Target, threads: int | None = None
) -> PrimFunc:
    """The kernel alone: (k [n_tok, k_heads, dk], g [n_tok, v_heads], beta, indptr) -> tinv
    [n_tok, v_heads, chunk] bf16 (for the tests; the model runs it inside gdn_chunked_mma's
    `wy` functions)."""
    if v_heads % k_heads:
        raise ValueError(f"k_heads {k_heads} must divide v_heads {v_heads}")
    body = inverse_launch(k_heads, v_heads, dk, chunk, target.kind.name == "cuda", threads)

    @T.prim_func(s_tir=True)
    def gdn_chunk_inverse(
        k_h: T.handle, g_h: T.handle, beta_h: T.handle, indptr_h: T.handle, tinv_h: T.handle
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr = T.int32(), T.int32()
        k = T.match_buffer(k_h, (n_tok, k_heads, dk), "float32")
        g = T.match_buffer(g_h, (n_tok, v_heads), "float32")
        beta = T.match_buffer(beta_h, (n_tok, v_heads), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        tinv = T.match_buffer(tinv_h, (n_tok, v_heads, chunk), "bfloat16")
        body(k, g, beta, indptr, tinv, n_ptr - 1, n_tok)

    return gdn_chunk_inverse
