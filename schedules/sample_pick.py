"""A sampled row's next token, drawn where its logits are: so a request with a temperature
takes its token the way a greedy one does, 8 bytes back to the host, and its steps can be
launched ahead (runtime/launched.py) instead of waiting for the host to sample a 1 MB row.

Two ways, chosen a row by its top_k:
- top_k in 1..K_MAX: the k largest of x / temperature (ties to the lower id, as the host's
  sampler), then top_p and min_p over them and a draw by inverse CDF with one uniform;
- top_k off: Gumbel-max, the argmax of x / temperature + Gumbel noise over every decodable
  column (with top_p, over the nucleus that schedules/nucleus.py finds first; with min_p, over
  the columns of at least min_p times the peak's weight), an exact draw from the tempered,
  filtered distribution.
top_k past K_MAX stays with the host's sampler.

Randomness is counter-based (schedules/draw_hash.py): a row's draw depends on its request's
seed and its position only, never on the batch it ran in.

Two kernels, after schedules/nucleus.py's in the form with nucleus rows (top_p or min_p
without top_k: their peaks and floors; other rows' blocks end at once). The first is a block a
(row, chunk of the decodable columns): it keeps each column's score (y, or y + noise) in shared
memory; each warp lists the `rounds` best of its part in order (`rounds` = k, or 1 for
Gumbel-max), one argmax by shuffles a round, and warp 0 merges the warps' lists into the
chunk's; it also leaves the chunk's (max, sum of exp) of the raw logits for the logprob. The
second is a block a row: warp 0 runs a tournament over the chunks' sorted lists for the row's
`rounds` best in order, then the draw. No round waits at a block barrier. Only decodable
columns are read: pads never compete. The logprob reported is the raw distribution's
(temperature 1, no filter), as the host's `Sampler.logprob` gives it.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from . import nucleus
from .draw_hash import DRAW, mix, row_key, uniform
from .greedy import CHUNKS
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers
from .pick_triples import FULL_MASK, merge, merged_warps, start, take, warps_triples

K_MAX = 64  # the largest top_k sampled here: a chunk's list, the merge's shared memory
THREADS = 256
BIG = 1 << 30  # a position past every real one


def workspace_shapes(n) -> list[tuple[tuple, str]]:
    """(shape, dtype) of the chunks' sorted lists (scores, column ids) and their raw (max, sum
    of exp), then schedules/nucleus.py's (the floors first)."""
    lists = [((n, CHUNKS, K_MAX), "float32"), ((n, CHUNKS, K_MAX), "int32")]
    return lists + [((n, CHUNKS, 2), "float32")] + nucleus.workspace_shapes(n)


def rounds_of(ints, b):
    """How many best scores a chunk lists for row b: its top_k, or 1 (Gumbel-max)."""
    return T.if_then_else(ints[b, 0] >= 1, T.min(ints[b, 0], K_MAX), 1)


def listed(cand, pick, q):
    """The score of the row's q-th best, -inf where there was none."""
    at = T.max(pick[q], 0)
    return T.if_then_else(pick[q] >= 0, cand[at // K_MAX, at % K_MAX], T.float32("-inf"))


def _after(s, j, lv, lj):
    """Whether score s at j comes after (lv, lj) in the order: score down, then j up."""
    return tirx.Or(s < lv, tirx.And(s == lv, j > lj))


@T.macro
def warp_best(v, j):
    """Each lane of a warp ends with the warp's best (v[0], j[0]): largest, then lowest j."""
    for s in T.unroll(5):
        ov: T.let[T.float32] = T.tvm_warp_shuffle_xor(FULL_MASK, v[0], 1 << s, 32, 32)
        oj: T.let[T.int32] = T.tvm_warp_shuffle_xor(FULL_MASK, j[0], 1 << s, 32, 32)
        if ov > v[0] or (ov == v[0] and oj < j[0]):
            v[0] = ov
            j[0] = oj


def sample_pick(decodable: int, selection: int, target: Target, nucleus_rows: bool = True
                ) -> PrimFunc:  # fmt: skip
    """`sample_pick(logits, rows, floats, ints, best, logprob, ws_v, ws_i, ws_t, *ws_nucleus)`:
    for each i, row rows[i] of the logits [batch, selection] drawn with floats[i] =
    (temperature, top_p, min_p) and ints[i] = (top_k, seed low, seed high, counter); its token
    and raw logprob are written to best[rows[i]] and logprob[rows[i]] (the step's own pick
    buffers, in place). Workspaces: `workspace_shapes(n)`. Without `nucleus_rows` the nucleus
    kernels are left out and their workspaces untouched: no row may then ask for top_p or
    min_p without top_k (the runtime calls this form for batches without such a row, five
    launches fewer)."""
    gpu = target.kind.name == "cuda"
    nt = THREADS if gpu else 1
    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)
    warps = nt // 32 if gpu else 1
    shared = "shared" if gpu else "global"
    span = -(-decodable // CHUNKS)
    per_lane = -(-span // nt)
    per_merge = -(-CHUNKS // nt)
    wl = 32 if gpu else 1  # lanes a warp: the CPU runs one lane a block
    sub = per_lane * wl  # a warp's sub-chunk of scores
    lists = CHUNKS // wl  # chunk lists a lane of the tournament holds
    each_list = T.unroll if gpu else T.serial  # the GPU's 4 heads stay in registers
    each_load = T.unroll if gpu else T.serial  # the GPU's loads all issued before their use
    floors = nucleus.nucleus_floors(decodable, selection, gpu)

    def filtered_out(x, y, top, ws_f, floats, b):
        """Whether a top_k-off column is out of its row's nucleus or under its min_p (top: the
        row's largest x / temperature); the form without nucleus kernels has no such rows."""
        if not nucleus_rows:
            return T.bool(False)
        return tirx.Or(x < ws_f[b], T.exp(y - top) < floats[b, 2])

    @T.macro
    def chunk_lists(logits, rows_buf, floats, ints, ws_v, ws_i, ws_t, ws_f, ws_peak, n):
        for bc in grid(n * CHUNKS):
            with T.sblock("chunk"):
                T.reads()
                T.writes()
                score = T.sblock_alloc_buffer((per_lane * nt,), "float32", scope=shared)
                tw = T.sblock_alloc_buffer((warps, 2), "float32", scope=shared)
                sub_v = T.sblock_alloc_buffer((warps, K_MAX), "float32", scope=shared)
                sub_j = T.sblock_alloc_buffer((warps, K_MAX), "int32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                b: T.let[T.int32] = bc // CHUNKS
                c0: T.let[T.int32] = bc % CHUNKS * span
                r: T.let[T.int32] = rows_buf[b]
                for tx in lanes():
                    with T.sblock("scores"):
                        T.reads()
                        T.writes()
                        h = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                        hc = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                        run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        row_key(h, ints, b)
                        start(run, arg)
                        xs = T.sblock_alloc_buffer((per_lane,), "float32", scope="local")
                        top = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        top[0] = T.float32("-inf")
                        if nucleus_rows:  # a min_p row's peak, from the nucleus's first kernel
                            if floats[b, 2] > T.float32(0):
                                nucleus.row_peak(top, ws_peak, b)
                        top[0] = top[0] / floats[b, 0]
                        # every load first: one after another behind the hash and logs left
                        # one L2 round trip in flight a lane
                        for e in each_load(per_lane):
                            j: T.let[T.int32] = e * nt + tx
                            live: T.let[T.bool] = j < span and c0 + j < decodable
                            xs[e] = T.if_then_else(
                                live, logits[r, T.min(c0 + j, decodable - 1)], T.float32("-inf")
                            )
                        for e in each_load(per_lane):
                            j: T.let[T.int32] = e * nt + tx
                            take(run, arg, xs[e], c0 + j)
                            y: T.let[T.float32] = xs[e] / floats[b, 0]
                            if ints[b, 0] >= 1 or xs[e] == T.float32("-inf"):
                                score[j] = y
                            elif filtered_out(xs[e], y, top[0], ws_f, floats, b):
                                score[j] = T.float32("-inf")
                            else:
                                hc[0] = T.bitwise_xor(h[0], T.Cast("uint32", c0 + j))
                                mix(hc)
                                # Gumbel noise -log(E), E = -log1p(-v) exponential: the
                                # winners' E is tiny, and log(1 - v) by a fast-math logf near
                                # 1 is off by ~4e-7 absolute (6% at E = 6e-6); log1pf has no
                                # such intrinsic
                                score[j] = y - T.log(-T.log1p(-uniform(hc[0])))
                        warps_triples(run, arg, tw, tx, gpu)
                for tx in lanes():
                    with T.sblock("triple"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        if tx == 0:
                            merged_warps(run, arg, tw, warps)
                            ws_t[b, bc % CHUNKS, 0] = run[0]
                            ws_t[b, bc % CHUNKS, 1] = run[1]
                k: T.let[T.int32] = rounds_of(ints, b)
                for tx in lanes():
                    with T.sblock("warp_lists"):
                        T.reads()
                        T.writes()
                        # warp w lists the best k of its sub-chunk in order, by shuffles only
                        v = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        at = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        last_v = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        last_j = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        w: T.let[T.int32] = tx // wl
                        last_v[0] = T.float32("inf")
                        last_j[0] = -1
                        for rd in T.serial(k):
                            v[0] = T.float32("-inf")
                            at[0] = BIG
                            for e in T.serial(per_lane):
                                j: T.let[T.int32] = w * sub + e * wl + tx % wl
                                s: T.let[T.float32] = score[j]
                                ok: T.let[T.bool] = _after(s, j, last_v[0], last_j[0])
                                # Selects, not ifs: TVM's sync pass wants no shared loads in
                                # a condition
                                better: T.let[T.bool] = tirx.And(ok, s > v[0])
                                at[0] = T.Select(better, j, at[0])
                                v[0] = T.Select(better, s, v[0])
                            if gpu:
                                warp_best(v, at)
                            last_v[0] = v[0]
                            last_j[0] = at[0]
                            if tx % wl == 0:
                                sub_v[w, rd] = v[0]
                                sub_j[w, rd] = at[0]
                for tx in lanes():
                    with T.sblock("chunk_list"):
                        T.reads()
                        T.writes()
                        # warp 0 merges the warps' lists: lane l holds list l's next entry
                        v = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        at = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        head = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        if tx < wl:
                            head[0] = 0
                            mine: T.let[T.int32] = T.min(tx, warps - 1)
                            for rd in T.serial(k):
                                live: T.let[T.bool] = tirx.And(tx < warps, head[0] < k)
                                at_head: T.let[T.int32] = T.min(head[0], K_MAX - 1)
                                hv: T.let[T.float32] = sub_v[mine, at_head]
                                hj: T.let[T.int32] = sub_j[mine, at_head]
                                v[0] = T.Select(live, hv, T.float32("-inf"))
                                at[0] = T.Select(live, hj, BIG)
                                if gpu:  # ties: the lower position, so the lower id
                                    warp_best(v, at)
                                found: T.let[T.bool] = v[0] > T.float32("-inf")
                                took: T.let[T.bool] = tirx.all(live, hj == at[0], found)
                                head[0] = head[0] + T.Select(took, 1, 0)
                                if tx == 0:
                                    ws_v[b, bc % CHUNKS, rd] = v[0]
                                    ws_i[b, bc % CHUNKS, rd] = c0 + at[0]

    @T.macro
    def row_draw(logits, rows_buf, floats, ints, best, logprob, ws_v, ws_i, ws_t, n):
        for b in grid(n):
            with T.sblock("row"):
                T.reads()
                T.writes()
                cand = T.sblock_alloc_buffer((CHUNKS, K_MAX), "float32", scope=shared)
                pick = T.sblock_alloc_buffer((K_MAX,), "int32", scope=shared)
                tw = T.sblock_alloc_buffer((warps, 2), "float32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                k: T.let[T.int32] = rounds_of(ints, b)
                for tx in lanes():
                    with T.sblock("load"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        start(run, arg)
                        for e in T.serial(per_merge):
                            c: T.let[T.int32] = e * nt + tx
                            if c < CHUNKS:
                                merge(run, arg, ws_t[b, c, 0], 0, ws_t[b, c, 1])
                        # the lists, every thread's loads at once (coalesced along the lists)
                        for e in each_load(CHUNKS * K_MAX // nt):
                            at: T.let[T.int32] = e * nt + tx
                            if at % K_MAX < k:
                                cand[at // K_MAX, at % K_MAX] = ws_v[b, at // K_MAX, at % K_MAX]
                        warps_triples(run, arg, tw, tx, gpu)
                for tx in lanes():
                    with T.sblock("tournament"):
                        T.reads()
                        T.writes()
                        # warp 0: lane l holds the next entries of lists l, l + 32, ...; an
                        # entry's place c * K_MAX + head orders ties by chunk, so by id
                        v = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        at = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        heads = T.sblock_alloc_buffer((lists,), "int32", scope="local")
                        if tx < wl:
                            for m in each_list(lists):
                                heads[m] = 0
                            for rd in T.serial(k):
                                v[0] = T.float32("-inf")
                                at[0] = BIG
                                for m in each_list(lists):
                                    c: T.let[T.int32] = m * wl + tx
                                    hd: T.let[T.int32] = heads[m]
                                    s: T.let[T.float32] = cand[c, T.min(hd, K_MAX - 1)]
                                    better: T.let[T.bool] = tirx.And(hd < k, s > v[0])
                                    at[0] = T.Select(better, c * K_MAX + hd, at[0])
                                    v[0] = T.Select(better, s, v[0])
                                if gpu:
                                    warp_best(v, at)
                                # -1: every list ran out (fewer decodable columns than k)
                                found: T.let[T.bool] = v[0] > T.float32("-inf")
                                for m in each_list(lists):
                                    took: T.let[T.bool] = tirx.And(
                                        found, at[0] == (m * wl + tx) * K_MAX + heads[m]
                                    )
                                    heads[m] = heads[m] + T.Select(took, 1, 0)
                                if tx == 0:
                                    pick[rd] = T.Select(found, at[0], -1)
                for tx in lanes():
                    with T.sblock("draw"):
                        T.reads()
                        T.writes()
                        h = T.sblock_alloc_buffer((1,), "uint32", scope="local")
                        run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        acc = T.sblock_alloc_buffer((3,), "float32", scope="local")
                        sel = T.sblock_alloc_buffer((2,), "int32", scope="local")
                        if tx == 0:
                            merged_warps(run, arg, tw, warps)
                            peak: T.let[T.float32] = listed(cand, pick, 0)
                            # acc: total weight, the nucleus's weight, the running sum
                            acc[0] = T.float32(0)
                            for q in T.serial(k):
                                acc[0] = acc[0] + T.exp(listed(cand, pick, q) - peak)
                            sel[0] = k  # the nucleus's size: the shortest prefix with top_p
                            acc[1] = T.float32(0)
                            for q in T.serial(k):
                                # then min_p, a prefix too: the list ends before its first
                                # weight under min_p
                                open_: T.let[T.bool] = sel[0] == k
                                wq: T.let[T.float32] = T.exp(listed(cand, pick, q) - peak)
                                under: T.let[T.bool] = tirx.And(open_, wq < floats[b, 2])
                                sel[0] = T.Select(under, q, sel[0])
                                kept: T.let[T.bool] = tirx.And(open_, tirx.Not(under))
                                acc[1] = acc[1] + T.Select(kept, wq, T.float32(0))
                                enough: T.let[T.bool] = acc[1] >= floats[b, 1] * acc[0]
                                full: T.let[T.bool] = tirx.And(kept, enough)
                                sel[0] = T.Select(full, q + 1, sel[0])
                            row_key(h, ints, b)
                            h[0] = T.bitwise_xor(h[0], T.uint32(DRAW))
                            mix(h)
                            point: T.let[T.float32] = uniform(h[0]) * acc[1]
                            sel[1] = 0
                            acc[2] = T.float32(0)
                            for q in T.serial(k):
                                # the first with the running sum past the point; a point
                                # rounded past the total keeps the last with weight
                                wq: T.let[T.float32] = T.exp(listed(cand, pick, q) - peak)
                                live: T.let[T.bool] = tirx.And(q < sel[0], wq > T.float32(0))
                                sel[1] = T.Select(tirx.And(live, acc[2] <= point), q, sel[1])
                                acc[2] = acc[2] + T.Select(live, wq, T.float32(0))
                            at: T.let[T.int32] = T.max(pick[sel[1]], 0)
                            token: T.let[T.int32] = ws_i[b, at // K_MAX, at % K_MAX]
                            best[rows_buf[b]] = token
                            logprob[rows_buf[b]] = (
                                logits[rows_buf[b], token] - run[0] - T.log(run[1])
                            )

    @T.prim_func(s_tir=True)
    def sample_pick(
        logits_h: T.handle,
        rows_h: T.handle,
        floats_h: T.handle,
        ints_h: T.handle,
        best_h: T.handle,
        logprob_h: T.handle,
        ws_v_h: T.handle,
        ws_i_h: T.handle,
        ws_t_h: T.handle,
        ws_f_h: T.handle,
        ws_peak_h: T.handle,
        ws_hist_h: T.handle,
        ws_keys_h: T.handle,
        ws_cut_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch, n = T.int32(), T.int32()
        logits = T.match_buffer(logits_h, (batch, selection), "float32")
        rows_buf = T.match_buffer(rows_h, (n,), "int32")
        floats = T.match_buffer(floats_h, (n, 3), "float32")
        ints = T.match_buffer(ints_h, (n, 4), "int32")
        best = T.match_buffer(best_h, (batch,), "int32")
        logprob = T.match_buffer(logprob_h, (batch,), "float32")
        ws_v = T.match_buffer(ws_v_h, (n, CHUNKS, K_MAX), "float32")
        ws_i = T.match_buffer(ws_i_h, (n, CHUNKS, K_MAX), "int32")
        ws_t = T.match_buffer(ws_t_h, (n, CHUNKS, 2), "float32")
        ws_f = T.match_buffer(ws_f_h, (n,), "float32")
        ws_peak = T.match_buffer(ws_peak_h, (n, nucleus.SLICES), "float32")
        ws_hist = T.match_buffer(ws_hist_h, (n, nucleus.ROUNDS, nucleus.BUCKETS), "float64")
        ws_keys = T.match_buffer(ws_keys_h, (n, nucleus.ROUNDS, 2, nucleus.BUCKETS), "uint32")
        ws_cut = T.match_buffer(ws_cut_h, (n, nucleus.ROUNDS, nucleus.CUT), "float64")
        if nucleus_rows:
            floors(logits, rows_buf, floats, ints, ws_f, ws_peak, ws_hist, ws_keys, ws_cut, n)
        chunk_lists(logits, rows_buf, floats, ints, ws_v, ws_i, ws_t, ws_f, ws_peak, n)
        row_draw(logits, rows_buf, floats, ints, best, logprob, ws_v, ws_i, ws_t, n)

    name = "sample_pick_nucleus" if nucleus_rows else "sample_pick"
    return sample_pick.with_attr("global_symbol", name)
