"""The logits projection: hidden × W[:selection]ᵀ with columns [decodable, selection) forced
to -inf in the same kernel, and beside the logits the first half of each row's greedy pick.

Projecting onto `selection` (a multiple of 128) instead of the odd `decodable` width keeps
the weight rows aligned for vectorised loads; the pad rows are real trained embeddings, so
their columns are masked here, where nothing downstream can forget to.

The pick's half: for every row and every CHUNK_COLS columns, the triple (max, first argmax,
sum of exp(x - max)) over the chunk's decodable columns (schedules/pick_triples.py), which
schedules/greedy.greedy_pick merges into the row's pick. The tensor-core kernel makes them from
its accumulators (a block's columns are a chunk; schedules/logits_mma.py), so a greedy step
reads its logits back from no kernel; the other builds scan their logits once written.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .greedy import chunk_triples
from .logits_mma import logits_gpu_mma
from .pdl import release_dependents, wait_for_producers
from .pick_triples import CHUNK_COLS, pick_chunks


def logits_projection(
    hidden: int,
    rows: int,
    decodable: int,
    selection: int,
    dtype: str,
    target: Target,
    mask_pad: bool = True,
) -> PrimFunc:
    """The logits kernel for `target`: `logits(x, w, out, ws_val, ws_idx)`, the triples
    [batch, pick_chunks(selection), 2] (max, sum) and [..] (argmax). `mask_pad=False` exists
    only so the test suite can prove its mask test fails on an unmasked build; the compiler
    never sets it otherwise (the triples count only decodable columns either way)."""
    if not 0 < decodable <= selection <= rows:
        raise ValueError(f"need 0 < decodable {decodable} <= selection {selection} <= rows {rows}")
    live = decodable if mask_pad else selection
    chunks = pick_chunks(selection)
    if target.kind.name == "cuda" and dtype == "bfloat16" and hidden % 256 == 0:
        body = logits_gpu_mma(hidden, live, decodable, selection, dtype)
    else:
        project = (_logits_cpu if target.kind.name != "cuda" else _logits_gpu)(
            hidden, live, selection, dtype
        )
        scan = chunk_triples(decodable, CHUNK_COLS, chunks, target, masked=False)

        @T.macro
        def body(x, w, out, ws_val, ws_idx, batch):
            project(x, w, out, batch)
            scan(out, out, out, ws_val, ws_idx, batch)  # no rows, no mask

    @T.prim_func(s_tir=True)
    def logits(x_h: T.handle, w_h: T.handle, out_h: T.handle, ws_val_h: T.handle,
               ws_idx_h: T.handle):  # fmt: skip
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch = T.int32()
        x = T.match_buffer(x_h, (batch, hidden), dtype)
        w = T.match_buffer(w_h, (rows, hidden), dtype)
        out = T.match_buffer(out_h, (batch, selection), "float32")
        ws_val = T.match_buffer(ws_val_h, (batch, chunks, 2), "float32")
        ws_idx = T.match_buffer(ws_idx_h, (batch, chunks), "int32")
        body(x, w, out, ws_val, ws_idx, batch)

    return logits


def _logits_cpu(hidden: int, live: int, selection: int, dtype: str):
    """Columns run in parallel; each reads its weight row once for the whole batch."""
    neg_inf = T.float32("-inf")

    @T.macro
    def body(x, w, out, batch):
        for j in T.parallel(selection):
            for b in T.serial(batch):
                with T.sblock("logits"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32")
                    if j < live:
                        acc[0] = T.float32(0)
                        for d in T.serial(hidden):
                            acc[0] = acc[0] + T.Cast("float32", x[b, d]) * T.Cast(
                                "float32", w[j, d]
                            )
                        out[b, j] = acc[0]
                    else:
                        out[b, j] = neg_inf

    return body


def _logits_gpu(hidden: int, live: int, selection: int, dtype: str):
    """A warp owns COLS adjacent columns; each lane streams its slice of their
    weight rows with 128-bit loads and reuses every hidden-vector load across those columns.
    Batches are taken BT rows at a time, so the weight slice is re-read from cache, not DRAM.
    Pad columns never load their row: they are written -inf directly."""
    vec = 16 // (2 if dtype in ("bfloat16", "float16") else 4)  # elements per 128-bit load
    if hidden % vec:
        raise ValueError(f"hidden size {hidden} must be a multiple of {vec}")
    lanes, cols, warps, bt = 32, 4, 4, 16
    k_iters = -(-hidden // (lanes * vec))
    n_blocks = -(-selection // (cols * warps))
    neg_inf = T.float32("-inf")

    @T.macro
    def body(x, w, out, batch):
        for bx in T.thread_binding(n_blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                    with T.sblock("logits"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((bt * cols,), "float32", scope="local")
                        w_loc = T.sblock_alloc_buffer((cols, vec), dtype, scope="local")
                        x_loc = T.sblock_alloc_buffer((vec,), dtype, scope="local")
                        part = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        red = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                        T.evaluate(release_dependents(True))
                        col0: T.let[T.int32] = (bx * warps + ty) * cols
                        for b0 in T.serial(T.ceildiv(batch, bt)):
                            for i in T.unroll(bt * cols):
                                acc[i] = T.float32(0)
                            for kk in T.serial(k_iters):
                                k0: T.let[T.int32] = (kk * lanes + tx) * vec
                                if k0 < hidden:
                                    for c in T.unroll(cols):
                                        if col0 + c < live:
                                            for v in T.vectorized(vec):
                                                w_loc[c, v] = w[col0 + c, k0 + v]
                                    for b in T.unroll(bt):
                                        if b0 * bt + b < batch:
                                            for v in T.vectorized(vec):
                                                x_loc[v] = x[b0 * bt + b, k0 + v]
                                            for c in T.unroll(cols):
                                                for v in T.unroll(vec):
                                                    acc[b * cols + c] = acc[b * cols + c] + T.Cast(
                                                        "float32", x_loc[v]
                                                    ) * T.Cast("float32", w_loc[c, v])
                            for b in T.serial(bt):
                                if b0 * bt + b < batch:
                                    for c in T.serial(cols):
                                        part[0] = acc[b * cols + c]
                                        with T.sblock("lane_sum"):
                                            T.reads(part[0])
                                            T.writes(red[0])
                                            T.attr(
                                                T.comm_reducer(
                                                    lambda a0, b0_: a0 + b0_, [T.float32(0)]
                                                ),
                                                "reduce_scope",
                                                T.int32(0),
                                            )
                                            T.tvm_thread_allreduce(
                                                T.uint32(1),
                                                part[0],
                                                True,
                                                red[0],
                                                tx,
                                                dtype="void",
                                            )
                                        if tx == 0 and col0 + c < selection:
                                            out[b0 * bt + b, col0 + c] = T.if_then_else(
                                                col0 + c < live, red[0], neg_inf
                                            )

    return body
