"""Each logits row's greedy pick: the argmax over the decodable columns and its logprob, and
the same under a token bitmask (constrained decoding).

Run where the logits are, so a greedy decode step brings 8 bytes a row to the host instead
of the whole 248,192-column row. Only the first `decodable` columns are read: pad columns
never compete, whether or not the logits kernel masked them.

One block per row: each thread scans a strided share of the columns, then the block reduces
in shared memory by halving strides, once for the (max, first index) and once for the sum
of exp(x - max). Ties go to the lower id, as numpy's argmax does. Lanes past the live half
of a step compute values nobody reads, which keeps every shared access unconditional.

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

GPU_THREADS = 512


def mask_words(decodable: int) -> int:
    """int32 words of one row's bitmask (xgrammar's width; pad columns have no bits)."""
    return (decodable + 31) // 32


def _loops(target: Target) -> tuple[bool, int, object, object]:
    gpu = target.kind.name == "cuda"
    nt = GPU_THREADS if gpu else 1

    def rows(n):
        return T.thread_binding(n, thread="blockIdx.x") if gpu else T.parallel(n)

    def lanes():
        return T.thread_binding(nt, thread="threadIdx.x") if gpu else T.serial(nt)

    return gpu, nt, rows, lanes


def greedy_pick(
    decodable: int, selection: int, target: Target, masked: bool = False
) -> PrimFunc:
    """`greedy_pick(logits, best, logprob)`, or with `masked`
    `masked_greedy_pick(logits, rows, bitmask, best, logprob)`: row `rows[i]` of the logits
    under mask row i, results in slot i."""
    gpu, nt, rows, lanes = _loops(target)
    steps = nt.bit_length() - 1  # nt is a power of two
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
    def pick(logits, rows_buf, bitmask, best, logprob, n):
        for b in rows(n):
            with T.sblock("row"):
                T.reads()
                T.writes()
                r: T.let[T.int32] = source(rows_buf, b)
                # Reductions ping-pong between two rows: step s reads row s % 2 and every lane
                # writes only its own slot of the other, so no lane reads what another writes.
                vals = T.sblock_alloc_buffer((2, nt), "float32", scope=shared)
                ids = T.sblock_alloc_buffer((2, nt), "int32", scope=shared)
                sums = T.sblock_alloc_buffer((2, nt), "float32", scope=shared)
                for tx in lanes():
                    with T.sblock("scan_max"):
                        T.reads()
                        T.writes()
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        i = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        m[0] = T.float32("-inf")
                        i[0] = 0
                        for e in T.serial((decodable + nt - 1) // nt):
                            c: T.let[T.int32] = e * nt + tx
                            if live(bitmask, b, c):
                                if logits[r, c] > m[0]:  # ascending c: the first max stays
                                    m[0] = logits[r, c]
                                    i[0] = c
                        vals[0, tx] = m[0]
                        ids[0, tx] = i[0]
                for s in T.serial(steps):
                    for tx in lanes():
                        with T.sblock("reduce_max"):
                            T.reads()
                            T.writes()
                            # TVM's sync pass wants shared loads outside conditions.
                            o: T.let[T.int32] = T.min(tx + T.shift_right(nt, s + 1), nt - 1)
                            ov: T.let[T.float32] = vals[s % 2, o]
                            oi: T.let[T.int32] = ids[s % 2, o]
                            cv: T.let[T.float32] = vals[s % 2, tx]
                            ci: T.let[T.int32] = ids[s % 2, tx]
                            better: T.let[T.bool] = ov > cv or (ov == cv and oi < ci)
                            vals[1 - s % 2, tx] = T.Select(better, ov, cv)
                            ids[1 - s % 2, tx] = T.Select(better, oi, ci)
                for tx in lanes():
                    with T.sblock("scan_sum"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        peak: T.let[T.float32] = vals[steps % 2, 0]
                        acc[0] = T.float32(0)
                        for e in T.serial((decodable + nt - 1) // nt):
                            c: T.let[T.int32] = e * nt + tx
                            if live(bitmask, b, c):
                                acc[0] = acc[0] + T.exp(logits[r, c] - peak)
                        sums[0, tx] = acc[0]
                for s in T.serial(steps):
                    for tx in lanes():
                        with T.sblock("reduce_sum"):
                            T.reads()
                            T.writes()
                            o: T.let[T.int32] = T.min(tx + T.shift_right(nt, s + 1), nt - 1)
                            sums[1 - s % 2, tx] = sums[s % 2, tx] + sums[s % 2, o]
                for tx in lanes():
                    with T.sblock("write"):
                        T.reads()
                        T.writes()
                        pick_id: T.let[T.int32] = ids[steps % 2, 0]
                        total: T.let[T.float32] = sums[steps % 2, 0]
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
        ):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            batch, n = T.int32(), T.int32()
            logits = T.match_buffer(logits_h, (batch, selection), "float32")
            rows_buf = T.match_buffer(rows_h, (n,), "int32")
            bitmask = T.match_buffer(bitmask_h, (n, mask_words(decodable)), "int32")
            best = T.match_buffer(best_h, (n,), "int32")
            logprob = T.match_buffer(logprob_h, (n,), "float32")
            pick(logits, rows_buf, bitmask, best, logprob, n)

        return masked_greedy_pick

    @T.prim_func(s_tir=True)
    def greedy_pick(logits_h: T.handle, best_h: T.handle, logprob_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch = T.int32()
        logits = T.match_buffer(logits_h, (batch, selection), "float32")
        best = T.match_buffer(best_h, (batch,), "int32")
        logprob = T.match_buffer(logprob_h, (batch,), "float32")
        pick(logits, best, logits, best, logprob, batch)  # rows and bitmask unused

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
