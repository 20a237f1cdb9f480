"""Each logits row's greedy pick: the argmax over the decodable columns and its logprob, and
the same under a token bitmask (constrained decoding).

Run where the logits are, so a greedy decode step brings 8 bytes a row to the host instead
of the whole 248,192-column row. Only the first `decodable` columns are read: pad columns
never compete, whether or not the logits kernel masked them.

A row is cut into CHUNKS chunks, a block each, so that one row (a batch-1 decode step) still
fills the GPU; each thread keeps a running (max, first index, sum of exp(x - max)) in one pass
over its columns, the block reduces them in shared memory by halving strides, and a second
kernel combines a row's chunks the same way. Ties go to the lower id, as numpy's argmax does.

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


def _term(x, m):
    """exp(x - m) with exp(-inf - -inf) = 0 (a part that saw no live column)."""
    return T.Select(x == T.float32("-inf"), T.float32(0), T.exp(x - m))


def workspace_shapes(n) -> tuple[tuple, tuple]:
    """The pick's workspaces for n rows: per-chunk (max, sum of exp) and argmax."""
    return (n, CHUNKS, 2), (n, CHUNKS)


def greedy_pick(
    decodable: int, selection: int, target: Target, masked: bool = False, gpu_lanes: bool = False
) -> PrimFunc:
    """`greedy_pick(logits, best, logprob, ws_val, ws_idx)`, or with `masked`
    `masked_greedy_pick(logits, rows, bitmask, best, logprob, ws_val, ws_idx)`: row `rows[i]`
    of the logits under mask row i, results in slot i. The workspaces are `workspace_shapes`.

    Two kernels: CHUNKS blocks a row each scan a chunk in one pass, keeping a running (max,
    first argmax, sum of exp(x - max)) a thread, and reduce the block's; then a block a row
    combines its chunks' triples. The CPU runs one lane a block, or with `gpu_lanes` the
    GPU's lanes one after another (slower: for tests of the lanes' indexing)."""
    gpu, nt, rows, lanes = _loops(target, GPU_THREADS, gpu_lanes)
    _, nt2, _, lanes2 = _loops(target, CHUNKS, gpu_lanes)
    span = -(-decodable // CHUNKS)  # columns a chunk
    per_lane = -(-span // nt)  # a lane's columns of its chunk (8 at Qwen3.5's vocabulary)
    shared = "shared" if gpu else "global"

    # Trace-time switches: the plain pick reads row b and every decodable column.
    def source(rows_buf, b):
        return rows_buf[b] if masked else b

    def live(bitmask, b, c):
        if not masked:
            return c < decodable
        # And() need not short-circuit: clamp so a lane past the end reads a real word.
        word = bitmask[b, T.min(c, decodable - 1) // 32]
        return tirx.And(c < decodable, T.bitwise_and(T.shift_right(word, c % 32), 1) != 0)

    @T.macro
    def reduce_triples(vals, ids, sums, lanes_, width):
        # Ping-pong between two rows: step s reads row s % 2 and every lane writes only its
        # own slot of the other, so no lane reads what another writes; the result is slot 0
        # of row steps % 2. Lanes past the live half compute values nobody reads.
        for s in T.serial(width.bit_length() - 1):
            for tx in lanes_():
                with T.sblock("reduce"):
                    T.reads()
                    T.writes()
                    # TVM's sync pass wants shared loads outside conditions.
                    o: T.let[T.int32] = T.min(tx + T.shift_right(width, s + 1), width - 1)
                    om: T.let[T.float32] = vals[s % 2, o]
                    oi: T.let[T.int32] = ids[s % 2, o]
                    os: T.let[T.float32] = sums[s % 2, o]
                    cm: T.let[T.float32] = vals[s % 2, tx]
                    ci: T.let[T.int32] = ids[s % 2, tx]
                    cs: T.let[T.float32] = sums[s % 2, tx]
                    better: T.let[T.bool] = om > cm or (om == cm and oi < ci)
                    top: T.let[T.float32] = T.max(om, cm)
                    vals[1 - s % 2, tx] = top
                    ids[1 - s % 2, tx] = T.Select(better, oi, ci)
                    sums[1 - s % 2, tx] = cs * _term(cm, top) + os * _term(om, top)

    @T.macro
    def pick(logits, rows_buf, bitmask, best, logprob, ws_val, ws_idx, n):
        for bc in rows(n * CHUNKS):
            with T.sblock("chunk"):
                T.reads()
                T.writes()
                vals = T.sblock_alloc_buffer((2, nt), "float32", scope=shared)
                ids = T.sblock_alloc_buffer((2, nt), "int32", scope=shared)
                sums = T.sblock_alloc_buffer((2, nt), "float32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                b: T.let[T.int32] = bc // CHUNKS
                r: T.let[T.int32] = source(rows_buf, b)
                c0: T.let[T.int32] = bc % CHUNKS * span
                for tx in lanes():
                    with T.sblock("scan"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((3,), "float32", scope="local")
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
                        run[0] = T.float32("-inf")
                        run[1] = T.float32(0)
                        arg[0] = 0
                        for e in T.unroll(per_lane):
                            x: T.let[T.float32] = xs[e]
                            if x > run[0]:  # ascending c: the first max stays
                                run[1] = run[1] * _term(run[0], x) + T.float32(1)
                                run[0] = x
                                arg[0] = c0 + e * nt + tx
                            else:
                                run[1] = run[1] + _term(x, run[0])
                        vals[0, tx] = run[0]
                        ids[0, tx] = arg[0]
                        sums[0, tx] = run[1]
                reduce_triples(vals, ids, sums, lanes, nt)
                for tx in lanes():
                    with T.sblock("chunk_out"):
                        T.reads()
                        T.writes()
                        m: T.let[T.float32] = vals[(nt.bit_length() - 1) % 2, 0]
                        i: T.let[T.int32] = ids[(nt.bit_length() - 1) % 2, 0]
                        sm: T.let[T.float32] = sums[(nt.bit_length() - 1) % 2, 0]
                        if tx == 0:
                            ws_val[b, bc % CHUNKS, 0] = m
                            ws_val[b, bc % CHUNKS, 1] = sm
                            ws_idx[b, bc % CHUNKS] = i
        for b in rows(n):
            with T.sblock("row"):
                T.reads()
                T.writes()
                vals = T.sblock_alloc_buffer((2, nt2), "float32", scope=shared)
                ids = T.sblock_alloc_buffer((2, nt2), "int32", scope=shared)
                sums = T.sblock_alloc_buffer((2, nt2), "float32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                for tx in lanes2():
                    with T.sblock("gather"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((3,), "float32", scope="local")
                        arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        run[0] = T.float32("-inf")
                        run[1] = T.float32(0)
                        arg[0] = 0
                        # ascending chunks: on equal maxima the lower id stays
                        for e in T.serial(CHUNKS // nt2):
                            m: T.let[T.float32] = ws_val[b, e * nt2 + tx, 0]
                            top: T.let[T.float32] = T.max(run[0], m)
                            run[1] = run[1] * _term(run[0], top) + ws_val[
                                b, e * nt2 + tx, 1
                            ] * _term(m, top)
                            if m > run[0]:
                                arg[0] = ws_idx[b, e * nt2 + tx]
                            run[0] = top
                        vals[0, tx] = run[0]
                        ids[0, tx] = arg[0]
                        sums[0, tx] = run[1]
                reduce_triples(vals, ids, sums, lanes2, nt2)
                for tx in lanes2():
                    with T.sblock("write"):
                        T.reads()
                        T.writes()
                        pick_id: T.let[T.int32] = ids[(nt2.bit_length() - 1) % 2, 0]
                        total: T.let[T.float32] = sums[(nt2.bit_length() - 1) % 2, 0]
                        if tx == 0:
                            best[b] = pick_id
                            logprob[b] = -T.log(total)

    # Parsed only for the variant asked for: `source` and `live` differ between them.
    if masked:

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
            pick(logits, rows_buf, bitmask, best, logprob, ws_val, ws_idx, n)

        return masked_greedy_pick

    @T.prim_func(s_tir=True)
    def greedy_pick(
        logits_h: T.handle,
        best_h: T.handle,
        logprob_h: T.handle,
        ws_val_h: T.handle,
        ws_idx_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch = T.int32()
        logits = T.match_buffer(logits_h, (batch, selection), "float32")
        best = T.match_buffer(best_h, (batch,), "int32")
        logprob = T.match_buffer(logprob_h, (batch,), "float32")
        ws_val = T.match_buffer(ws_val_h, (batch, CHUNKS, 2), "float32")
        ws_idx = T.match_buffer(ws_idx_h, (batch, CHUNKS), "int32")
        pick(logits, best, logits, best, logprob, ws_val, ws_idx, batch)  # no rows, no mask

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
