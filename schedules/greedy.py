"""Each logits row's greedy pick: the argmax over the decodable columns and its logprob, and
the same under a token bitmask (constrained decoding).

Run where the logits are, so a greedy decode step brings 8 bytes a row to the host instead
of the whole 248,192-column row. Only the first `decodable` columns count: pad columns never
compete, whether or not the logits kernel masked them.

A pick is a reduction of (max, first index, sum of exp(x - max)) triples
(schedules/pick_triples.py) in two halves. The plain pick's first half runs inside the logits
kernel, which leaves a triple per block of 128 columns beside its logits (schedules/logits.py),
so only the second, one block a row merging them, is a kernel of its own. The masked pick
reads the logits instead: CHUNKS blocks a row (one row still fills the GPU) each scan a chunk
in one pass, a running triple a thread, reduced in shared memory, then the same merge.

The masked variants read xgrammar's bitmask layout, [rows, ceil(decodable / 32)] int32 with
bit j % 32 of word j // 32 set when token j is allowed, for the logits rows listed in `rows`
(a subset of the batch: only constrained sequences carry a mask). `masked_greedy_pick` is
the pick and logprob of the masked distribution; `apply_token_bitmask` writes -inf in place
over the forbidden decodable columns, for rows the host samples.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers
from .pick_triples import last_row, merge, pick_chunks, reduce_shared, start, take, warp_merge

GPU_THREADS = 256
CHUNKS = 128  # column chunks of a row, a block each: one row alone spreads over the GPU


def mask_words(decodable: int) -> int:
    """int32 words of one row's bitmask (xgrammar's width; pad columns have no bits)."""
    return (decodable + 31) // 32


def _loops(
    target: Target, threads: int = GPU_THREADS, gpu_lanes: bool = False
) -> tuple[bool, int, object, object]:
    gpu = target.kind.name == "cuda"
    nt = threads if gpu or gpu_lanes else 1

    rows, lanes = block_loop(gpu), thread_loop(nt, gpu)

    return gpu, nt, rows, lanes


def workspace_shapes(n, chunks: int = CHUNKS) -> tuple[tuple, tuple]:
    """Triples of n rows' `chunks` chunks: (max, sum of exp) and argmax."""
    return (n, chunks, 2), (n, chunks)


def chunk_triples(
    decodable: int, span: int, chunks: int, target: Target, masked: bool, gpu_lanes: bool = False
):
    """A macro (logits, rows_buf, bitmask, ws_val, ws_idx, n): a kernel of a block per
    (row, chunk) writing the triple of that chunk's `span` live columns (the first of them at
    chunk * span): one pass keeping a running triple a lane, then the block's lanes reduced in
    shared memory. Live: decodable, and with `masked` allowed by mask row b (logits row
    rows_buf[b]). The CPU runs one lane a block, or with `gpu_lanes` the GPU's lanes one after
    another."""
    gpu, nt, rows, lanes = _loops(target, min(GPU_THREADS, span), gpu_lanes)
    per_lane = -(-span // nt)
    shared = "shared" if gpu else "global"

    # Trace-time switches: the plain scan reads row b and every decodable column.
    def source(rows_buf, b):
        return rows_buf[b] if masked else b

    def live(bitmask, b, c):
        if not masked:
            return c < decodable
        # And() need not short-circuit: clamp so a lane past the end reads a real word.
        word = bitmask[b, T.min(c, decodable - 1) // 32]
        return tirx.And(c < decodable, T.bitwise_and(T.shift_right(word, c % 32), 1) != 0)

    @T.macro
    def scan(logits, rows_buf, bitmask, ws_val, ws_idx, n):
        for bc in rows(n * chunks):
            with T.sblock("chunk"):
                T.reads()
                T.writes()
                vals = T.sblock_alloc_buffer((2, nt), "float32", scope=shared)
                ids = T.sblock_alloc_buffer((2, nt), "int32", scope=shared)
                sums = T.sblock_alloc_buffer((2, nt), "float32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                b: T.let[T.int32] = bc // chunks
                r: T.let[T.int32] = source(rows_buf, b)
                c0: T.let[T.int32] = bc % chunks * span
                for tx in lanes():
                    with T.sblock("scan"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        xs = T.sblock_alloc_buffer((per_lane,), "float32", scope="local")
                        # every load first, then the running triple: a load per step behind
                        # the previous step's compare left one L2 round trip in flight a lane
                        for e in T.unroll(per_lane):
                            c: T.let[T.int32] = c0 + e * nt + tx
                            # a column outside the chunk or not live reads as -inf: it can
                            # neither win nor add to the sum, as if skipped
                            xs[e] = T.if_then_else(
                                e * nt + tx < span and live(bitmask, b, c),
                                logits[r, T.min(c, decodable - 1)],
                                T.float32("-inf"),
                            )
                        start(run, arg)
                        for e in T.unroll(per_lane):
                            take(run, arg, xs[e], c0 + e * nt + tx)
                        vals[0, tx] = run[0]
                        ids[0, tx] = arg[0]
                        sums[0, tx] = run[1]
                reduce_shared(vals, ids, sums, lanes, nt)
                for tx in lanes():
                    with T.sblock("chunk_out"):
                        T.reads()
                        T.writes()
                        m: T.let[T.float32] = vals[last_row(nt), 0]
                        i: T.let[T.int32] = ids[last_row(nt), 0]
                        sm: T.let[T.float32] = sums[last_row(nt), 0]
                        if tx == 0:
                            ws_val[b, bc % chunks, 0] = m
                            ws_val[b, bc % chunks, 1] = sm
                            ws_idx[b, bc % chunks] = i

    return scan


def combine_triples(chunks: int, target: Target, gpu_lanes: bool = False):
    """A macro (ws_val, ws_idx, best, logprob, n): a block a row merges the row's `chunks`
    triples into its pick and logprob. A lane merges every GPU_THREADS-th chunk (its loads
    all first), then warps merge by shuffles and the warps' triples in warp 0. The CPU merges
    one lane's after another (with `gpu_lanes`, each of the GPU's lanes' first)."""
    gpu, nt, rows, lanes = _loops(target, GPU_THREADS, gpu_lanes)
    per_lane = -(-chunks // nt)
    warps = nt // 32 if gpu else nt
    shared = "shared" if gpu else "global"

    @T.macro
    def combine(ws_val, ws_idx, best, logprob, n):
        for b in rows(n):
            with T.sblock("row"):
                T.reads()
                T.writes()
                # the warps' triples on the GPU, the lanes' on the CPU
                vals = T.sblock_alloc_buffer((warps, 2), "float32", scope=shared)
                ids = T.sblock_alloc_buffer((warps,), "int32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                for tx in lanes():
                    with T.sblock("lane"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        start(run, arg)
                        if per_lane <= 16:  # the GPU's lanes: every load first
                            m = T.sblock_alloc_buffer((per_lane,), "float32", scope="local")
                            s = T.sblock_alloc_buffer((per_lane,), "float32", scope="local")
                            i = T.sblock_alloc_buffer((per_lane,), "int32", scope="local")
                            for e in T.unroll(per_lane):
                                c: T.let[T.int32] = T.min(e * nt + tx, chunks - 1)
                                m[e] = T.if_then_else(
                                    e * nt + tx < chunks, ws_val[b, c, 0], T.float32("-inf")
                                )
                                s[e] = ws_val[b, c, 1]
                                i[e] = ws_idx[b, c]
                            for e in T.unroll(per_lane):
                                merge(run, arg, m[e], i[e], s[e])
                        else:  # one CPU lane
                            for e in T.serial(per_lane):
                                if e * nt + tx < chunks:
                                    c: T.let[T.int32] = e * nt + tx
                                    merge(run, arg, ws_val[b, c, 0], ws_idx[b, c], ws_val[b, c, 1])
                        if gpu:
                            warp_merge(run, arg, 1, 5)
                            if tx % 32 == 0:
                                vals[tx // 32, 0] = run[0]
                                vals[tx // 32, 1] = run[1]
                                ids[tx // 32] = arg[0]
                        else:
                            vals[tx, 0] = run[0]
                            vals[tx, 1] = run[1]
                            ids[tx] = arg[0]
                for tx in lanes():
                    with T.sblock("pick"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        start(run, arg)
                        if gpu:
                            w: T.let[T.int32] = T.min(tx % 32, warps - 1)
                            merge(run, arg, T.if_then_else(tx % 32 < warps, vals[w, 0],
                                  T.float32("-inf")), ids[w], vals[w, 1])  # fmt: skip
                            warp_merge(run, arg, 1, (warps - 1).bit_length())
                        else:
                            for w in T.serial(warps):
                                merge(run, arg, vals[w, 0], ids[w], vals[w, 1])
                        if tx == 0:
                            best[b] = arg[0]
                            logprob[b] = -T.log(run[1])

    return combine


def greedy_pick(
    decodable: int, selection: int, target: Target, masked: bool = False, gpu_lanes: bool = False
) -> PrimFunc:
    """`greedy_pick(ws_val, ws_idx, best, logprob)`: each row's pick from the triples of its
    `logits.pick_chunks(selection)` chunks, which the logits kernel wrote beside its logits
    (over the decodable columns only). With `masked`,
    `masked_greedy_pick(logits, rows, bitmask, best, logprob, ws_val, ws_idx)`: row `rows[i]`
    of the logits under mask row i, results in slot i, from the logits themselves: CHUNKS
    blocks a row make the triples (workspaces `workspace_shapes(n)`), then the same merge."""
    if masked:
        span = -(-decodable // CHUNKS)  # columns a chunk
        scan = chunk_triples(decodable, span, CHUNKS, target, True, gpu_lanes)
        combine = combine_triples(CHUNKS, target, gpu_lanes)

        @T.prim_func(s_tir=True)
        def masked_greedy_pick(
            logits_h: T.handle,
            rows_h: T.handle,
            bitmask_h: T.handle,
            best_h: T.handle,
            logprob_h: T.handle,
            ws_val_h: T.handle,
            ws_idx_h: T.handle,
        ):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            batch, n = T.int32(), T.int32()
            logits = T.match_buffer(logits_h, (batch, selection), "float32")
            rows_buf = T.match_buffer(rows_h, (n,), "int32")
            bitmask = T.match_buffer(bitmask_h, (n, mask_words(decodable)), "int32")
            best = T.match_buffer(best_h, (n,), "int32")
            logprob = T.match_buffer(logprob_h, (n,), "float32")
            ws_val = T.match_buffer(ws_val_h, (n, CHUNKS, 2), "float32")
            ws_idx = T.match_buffer(ws_idx_h, (n, CHUNKS), "int32")
            scan(logits, rows_buf, bitmask, ws_val, ws_idx, n)
            combine(ws_val, ws_idx, best, logprob, n)

        return masked_greedy_pick

    chunks = pick_chunks(selection)
    combine = combine_triples(chunks, target, gpu_lanes)

    @T.prim_func(s_tir=True)
    def greedy_pick(
        ws_val_h: T.handle,
        ws_idx_h: T.handle,
        best_h: T.handle,
        logprob_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch = T.int32()
        ws_val = T.match_buffer(ws_val_h, (batch, chunks, 2), "float32")
        ws_idx = T.match_buffer(ws_idx_h, (batch, chunks), "int32")
        best = T.match_buffer(best_h, (batch,), "int32")
        logprob = T.match_buffer(logprob_h, (batch,), "float32")
        combine(ws_val, ws_idx, best, logprob, batch)

    return greedy_pick


def apply_token_bitmask(decodable: int, selection: int, target: Target) -> PrimFunc:
    """In place: logits[rows[i], c] = -inf for every decodable column c that mask row i
    forbids. Pad columns are neither read nor written (they are -inf already)."""
    _, nt, rows, lanes = _loops(target)
    words = mask_words(decodable)

    @T.prim_func(s_tir=True)
    def apply_token_bitmask(logits_h: T.handle, rows_h: T.handle, bitmask_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch, n = T.int32(), T.int32()
        logits = T.match_buffer(logits_h, (batch, selection), "float32")
        rows_buf = T.match_buffer(rows_h, (n,), "int32")
        bitmask = T.match_buffer(bitmask_h, (n, words), "int32")
        for b in rows(n):
            for tx in lanes():
                with T.sblock("mask"):
                    T.reads()
                    T.writes()
                    r: T.let[T.int32] = rows_buf[b]
                    for e in T.serial((decodable + nt - 1) // nt):
                        c: T.let[T.int32] = e * nt + tx
                        if c < decodable:
                            word: T.let[T.int32] = bitmask[b, c // 32]
                            if T.bitwise_and(T.shift_right(word, c % 32), 1) == 0:
                                logits[r, c] = T.float32("-inf")

    return apply_token_bitmask


def feed_picks(target: Target) -> PrimFunc:
    """The next decode step's inputs from this one's, in place on the device: each row of
    `step` [batch, 3] (token, slot, position) takes its greedy pick `best` [batch] as its
    token and moves one position on. So a step can be launched before the host has read the
    picks of the one before it (runtime/model_runner.py, `launch_decode`)."""
    gpu = target.kind.name == "cuda"
    grid, lanes = block_loop(gpu), thread_loop(64, gpu)

    @T.prim_func(s_tir=True)
    def picks_to_inputs(step_h: T.handle, best_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch = T.int32()
        step = T.match_buffer(step_h, (batch, 3), "int32")
        best = T.match_buffer(best_h, (batch,), "int32")
        for bx in grid((batch + 63) // 64):
            for tx in lanes():
                with T.sblock("feed"):
                    T.reads()
                    T.writes()
                    if bx * 64 + tx < batch:
                        step[bx * 64 + tx, 0] = best[bx * 64 + tx]
                        step[bx * 64 + tx, 2] = step[bx * 64 + tx, 2] + 1

    return picks_to_inputs
