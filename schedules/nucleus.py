"""A top_p row's nucleus on the device, whatever its size: the floor its logits must reach.

schedules/sample_pick.py draws top_k rows from their k best, so top_p alone (the common
OpenAI-client setting) had no list to cut and went to the host. Here a row's SLICES blocks find
the smallest most-likely set holding top_p of the tempered mass, as the value of its least
likely member; sample_pick's Gumbel-max then draws over the columns at or above it, an exact
draw from the renormalised nucleus.

No sort. A column's weight is exp2(-t), t = (peak - x) * log2(e) / temperature, in fixed point
(floor(weight * 2^32), integers held in float64): every sum is exact, so the float64 atomics
that build histograms give the same totals in any order, and a seeded draw stays the same
whatever the launch. Columns 32 or more binary orders below the peak weigh 0, so the nucleus's
mass is exact to a unit a column (at 248,077 columns, 6e-5 of the peak's weight).

A kernel a pass, each block of a row streaming its slice and adding its shared-memory histogram
into the row's global one: the slices' peaks (and the row's histograms cleared); the weights
histogrammed by t into BUCKETS buckets (0 = the largest values); then KEY_ROUNDS key passes,
each first finding the bucket where the running mass from the top reaches top_p * total and
splitting it by the logits' order-preserving uint32 keys, BITS at a time, until one value is
left; a last kernel finds the final bucket's value. Every block of a row finds the same bucket
from the same exact sums. Every member's columns are kept, ties with the last member included
(the host's sampler keeps the lower ids of a tie cut through; the two differ only there).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from .loops import thread_loop
from .pdl import release_dependents, wait_for_producers

THREADS = 256
# blocks a row: one block a row streamed its five passes at ~55 GB/s, 257 µs at 248k columns
# (H100, docs/results/sample_kernel_nucleus_vec4_h100_s33.json)
SLICES = 32
UNROLL, VEC = 4, 4  # a thread's loads a step, of VEC columns each (16 bytes)
BITS = 11
BUCKETS = 1 << BITS
FIXED = 2.0**32  # a weight's unit: 2^-32 of the peak's
PER_T = BUCKETS / 32.0  # buckets a unit of t: weights past t = 32 are 0
KEY_ROUNDS = 3  # 11 + 11 + 10 bits: a bucket of keys always ends as one value
ROUNDS = 1 + KEY_ROUNDS  # histograms a row: the weights', then the key passes'
CUT = 4  # a round's cut: the mass above its bucket, the target mass, the bucket's key range
LOG2E = math.log2(math.e)
NONE = T.float32("-inf")  # the floor of a row without a nucleus to find


def workspace_shapes(n) -> list[tuple[tuple, str]]:
    """(shape, dtype) of the floors, then of the slices' peaks, the rows' histograms, their
    buckets' key ranges (least, greatest) and each round's cut."""
    return [((n,), "float32"), ((n, SLICES), "float32"), ((n, ROUNDS, BUCKETS), "float64"),
            ((n, ROUNDS, 2, BUCKETS), "uint32"), ((n, ROUNDS, CUT), "float64")]  # fmt: skip


def key_of(x):
    """x's bits as a uint32 ordered as the floats are."""
    u = T.reinterpret("uint32", x)
    flip = T.Select(T.shift_right(u, T.uint32(31)) == T.uint32(1), T.uint32(0xFFFFFFFF),
                    T.uint32(0x80000000))  # fmt: skip
    return T.bitwise_xor(u, flip)


def value_of(key):
    """The float32 whose key_of is `key`."""
    positive = T.shift_right(key, T.uint32(31)) == T.uint32(1)
    u = T.Select(positive, T.bitwise_xor(key, T.uint32(0x80000000)), T.bitwise_not(key))
    return T.reinterpret("float32", u)


def wants_floor(floats, ints, b):
    """Whether row b asks for top_p without top_k."""
    return tirx.And(ints[b, 0] < 1, floats[b, 1] < T.float32(1))


def wants_peak(floats, ints, b):
    """Whether row b's peak is needed: top_p or min_p without top_k."""
    return tirx.And(ints[b, 0] < 1, tirx.Or(floats[b, 1] < T.float32(1),
                                            floats[b, 2] > T.float32(0)))  # fmt: skip


@T.macro
def row_peak(m, peak, b):
    """m[0] = row b's largest logit, from its slices' peaks (the first kernel's `peak`)."""
    m[0] = NONE
    for q in T.serial(SLICES):
        m[0] = T.max(m[0], peak[b, q])


def weight(t):
    """A column's fixed-point weight (float64, an integer) at t."""
    return T.floor(T.Cast("float64", T.exp2(-t)) * T.float64(FIXED))


def shift(span):
    """The shift that leaves a span of keys under BUCKETS buckets."""
    out = T.uint32(0)
    for i in range(32 - BITS):
        out = out + T.Select(T.shift_right(span, T.uint32(i + BITS)) > T.uint32(0),
                             T.uint32(1), T.uint32(0))  # fmt: skip
    return out


def nucleus_floors(decodable: int, selection: int, gpu: bool):
    """A macro (logits, rows, floats, ints, floor, peak, hist, keys, cut, n): floor[i] = the
    smallest logit in row rows[i]'s nucleus where its settings ask for top_p without top_k
    (ints[i, 0] < 1, floats[i, 1] < 1), else -inf. The other four are workspaces
    (`workspace_shapes`); peak[i] holds the row's slices' peaks where it asks for top_p or
    min_p (floats[i, 2] > 0) without top_k."""
    if decodable * FIXED >= 2.0**53:
        raise ValueError(f"{decodable} columns: their fixed-point sums would not be exact")
    nt = THREADS if gpu else 1
    wl = 32 if gpu else 1  # lanes of the scan: warp 0 (the CPU's one lane)
    warps = nt // 32 if gpu else 1
    lanes = thread_loop(nt, gpu)
    shared = "shared" if gpu else "global"
    vec = VEC if selection % VEC == 0 else 1  # a row's vectors then all lie inside it
    per = UNROLL * vec  # a thread's columns a step
    span = SLICES * nt  # a row's threads
    steps = -(-decodable // (span * per))
    per_scan = BUCKETS // wl

    def grid(extent):
        # serial on the CPU: a row's blocks add into the same global histograms
        return T.thread_binding(extent, thread="blockIdx.x") if gpu else T.serial(extent)

    @T.macro
    def load(logits, r, g, s, xs):
        # xs[u * vec + v] = column ((s * UNROLL + u) * span + g) * vec + v, -inf past the
        # decodable: a step's vectors all issued before any is used
        for u in T.unroll(UNROLL):
            c0: T.let[T.int32] = ((s * UNROLL + u) * span + g) * vec
            for v in T.vectorized(vec):
                xs[u * vec + v] = logits[r, T.min(c0, selection - vec) + v]
        for e in T.unroll(per):
            col: T.let[T.int32] = ((s * UNROLL + e // vec) * span + g) * vec + e % vec
            xs[e] = T.Select(col < decodable, xs[e], NONE)

    @T.macro
    def add(hs, lo, hi, d, w, key):
        if gpu:
            T.evaluate(T.cuda.atomic_add(T.address_of(hs[d]), w))
            T.evaluate(T.call_extern("uint32", "atomicMin", T.address_of(lo[d]), key))
            T.evaluate(T.call_extern("uint32", "atomicMax", T.address_of(hi[d]), key))
        else:
            hs[d] = hs[d] + w
            lo[d] = T.min(lo[d], key)
            hi[d] = T.max(hi[d], key)

    @T.macro
    def cleared(hs, lo, hi, on):
        for tx in lanes():
            with T.sblock("cleared"):
                T.reads()
                T.writes()
                for e in T.serial(T.Select(on, -(-BUCKETS // nt), 0)):
                    d: T.let[T.int32] = e * nt + tx
                    if d < BUCKETS:
                        hs[d] = T.float64(0)
                        lo[d] = T.uint32(0xFFFFFFFF)
                        hi[d] = T.uint32(0)
                if gpu:  # TVM's barriers do not see the atomics through address_of
                    T.tvm_storage_sync("shared")

    @T.macro
    def flush(hs, lo, hi, hist, keys, b, q, on):
        # a block's histogram into its row's round q
        for tx in lanes():
            with T.sblock("flush"):
                T.reads()
                T.writes()
                if gpu:  # after every thread's atomics
                    T.tvm_storage_sync("shared")
                for e in T.serial(T.Select(on, -(-BUCKETS // nt), 0)):
                    d: T.let[T.int32] = e * nt + tx
                    if d < BUCKETS:
                        w: T.let[T.float64] = hs[d]  # (no shared load in a condition)
                        if w > T.float64(0):
                            if gpu:
                                least = T.address_of(keys[b, q, 0, d])
                                most = T.address_of(keys[b, q, 1, d])
                                T.evaluate(T.cuda.atomic_add(T.address_of(hist[b, q, d]), w))
                                T.evaluate(T.call_extern("uint32", "atomicMin", least, lo[d]))
                                T.evaluate(T.call_extern("uint32", "atomicMax", most, hi[d]))
                            else:
                                hist[b, q, d] = hist[b, q, d] + w
                                keys[b, q, 0, d] = T.min(keys[b, q, 0, d], lo[d])
                                keys[b, q, 1, d] = T.max(keys[b, q, 1, d], hi[d])

    @T.macro
    def crossing(hist, keys, cut, floats, hs, sums, prev, found, b, q, on):
        # round q's bucket where the running mass from the top reaches the target (top_p *
        # the weights' total, from round 0's histogram): found = (the mass above it, the
        # target, its keys' range), else round q - 1's cut carried (a range of one value
        # was not split). Warp 0's lanes each sum a run of buckets, and the lane whose run
        # holds the crossing walks it.
        for tx in lanes():
            with T.sblock("gather"):
                T.reads()
                T.writes()
                for e in T.serial(T.Select(on, -(-BUCKETS // nt), 0)):
                    d: T.let[T.int32] = e * nt + tx
                    if d < BUCKETS:
                        hs[d] = hist[b, q, d]
                if tx == 0:
                    for i in T.serial(CUT):
                        v: T.let[T.float64] = T.float64(0) if q == 0 else cut[b, q - 1, i]
                        prev[i] = v
                        found[i] = v  # (not read back from prev: no barrier in a condition)
        for ln in lanes():
            with T.sblock("lane_sums"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((1,), "float64", scope="local")
                if ln < wl:
                    acc[0] = T.float64(0)
                    for i in T.serial(T.Select(on, per_scan, 0)):
                        acc[0] = acc[0] + hs[ln * per_scan + i]
                    sums[ln] = acc[0]
        for ln in lanes():
            with T.sblock("walk"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((3,), "float64", scope="local")
                at = T.sblock_alloc_buffer((1,), "int32", scope="local")
                if ln < wl:
                    acc[0] = prev[0]
                    acc[2] = prev[1]
                    for i in T.serial(wl):
                        acc[0] = acc[0] + T.Select(i < ln, sums[i], T.float64(0))
                        if q == 0:
                            acc[2] = acc[2] + sums[i]
                    if q == 0:
                        acc[2] = T.Cast("float64", floats[b, 1]) * acc[2]
                    acc[1] = sums[ln]
                    if acc[0] < acc[2] and acc[0] + acc[1] >= acc[2]:
                        at[0] = -1
                        for i in T.serial(per_scan):
                            acc[1] = hs[ln * per_scan + i]
                            if at[0] < 0:
                                if acc[0] + acc[1] >= acc[2]:
                                    at[0] = ln * per_scan + i
                                else:
                                    acc[0] = acc[0] + acc[1]
                        found[0] = acc[0]
                        found[1] = acc[2]
                        found[2] = T.Cast("float64", keys[b, q, 0, at[0]])
                        found[3] = T.Cast("float64", keys[b, q, 1, at[0]])

    @T.macro
    def peaks(logits, rows_buf, floats, ints, peak, hist, keys, n):
        for bs in grid(n * SLICES):
            with T.sblock("nucleus_peaks"):
                T.reads()
                T.writes()
                red = T.sblock_alloc_buffer((warps,), "float32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                b: T.let[T.int32] = bs // SLICES
                s: T.let[T.int32] = bs % SLICES
                r: T.let[T.int32] = rows_buf[b]
                on: T.let[T.bool] = wants_peak(floats, ints, b)
                for tx in lanes():
                    with T.sblock("slice_peak"):
                        T.reads()
                        T.writes()
                        xs = T.sblock_alloc_buffer((per,), "float32", scope="local")
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        m[0] = NONE
                        for st in T.serial(T.Select(on, steps, 0)):
                            load(logits, r, s * nt + tx, st, xs)
                            for u in T.unroll(per):
                                m[0] = T.max(m[0], xs[u])
                        if gpu:
                            for sh in T.unroll(5):
                                m[0] = T.max(m[0], T.tvm_warp_shuffle_xor(
                                    0xFFFFFFFF, m[0], 1 << sh, 32, 32))  # fmt: skip
                        if tx % 32 == 0:
                            red[tx // 32] = m[0]
                        # the row's histograms cleared for the passes ahead, a share a thread
                        for e in T.serial(T.Select(on, -(-(ROUNDS * BUCKETS) // span), 0)):
                            d: T.let[T.int32] = e * span + s * nt + tx
                            if d < ROUNDS * BUCKETS:
                                hist[b, d // BUCKETS, d % BUCKETS] = T.float64(0)
                                keys[b, d // BUCKETS, 0, d % BUCKETS] = T.uint32(0xFFFFFFFF)
                                keys[b, d // BUCKETS, 1, d % BUCKETS] = T.uint32(0)
                for tx in lanes():
                    with T.sblock("slice_peak_out"):
                        T.reads()
                        T.writes()
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        if tx == 0:
                            m[0] = NONE
                            for w in T.serial(warps):
                                m[0] = T.max(m[0], red[w])
                            peak[b, s] = m[0]

    @T.macro
    def histogram(logits, rows_buf, floats, ints, peak, hist, keys, cut, n, q):
        # pass q into round q's histograms: 0 the weights by t, then round q - 1's crossing
        # bucket split by its keys from its largest down
        for bs in grid(n * SLICES):
            with T.sblock("nucleus_pass"):
                T.reads()
                T.writes()
                hs = T.sblock_alloc_buffer((BUCKETS,), "float64", scope=shared)
                lo = T.sblock_alloc_buffer((BUCKETS,), "uint32", scope=shared)
                hi = T.sblock_alloc_buffer((BUCKETS,), "uint32", scope=shared)
                sums = T.sblock_alloc_buffer((wl,), "float64", scope=shared)
                prev = T.sblock_alloc_buffer((CUT,), "float64", scope=shared)
                found = T.sblock_alloc_buffer((CUT,), "float64", scope=shared)
                T.evaluate(wait_for_producers(gpu))
                T.evaluate(release_dependents(gpu))
                b: T.let[T.int32] = bs // SLICES
                s: T.let[T.int32] = bs % SLICES
                r: T.let[T.int32] = rows_buf[b]
                c: T.let[T.float32] = T.float32(LOG2E) / floats[b, 0]
                on: T.let[T.bool] = wants_floor(floats, ints, b)
                if q > 0:
                    crossing(hist, keys, cut, floats, hs, sums, prev, found, b, q - 1, on)
                cleared(hs, lo, hi, on)
                for tx in lanes():
                    with T.sblock("pass"):
                        T.reads()
                        T.writes()
                        xs = T.sblock_alloc_buffer((per,), "float32", scope="local")
                        rng = T.sblock_alloc_buffer((3,), "uint32", scope="local")
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        row_peak(m, peak, b)
                        if q == 0:
                            for st in T.serial(T.Select(on, steps, 0)):
                                load(logits, r, s * nt + tx, st, xs)
                                for u in T.unroll(per):
                                    t: T.let[T.float32] = (m[0] - xs[u]) * c
                                    wt: T.let[T.float64] = weight(t)
                                    if wt > T.float64(0):
                                        d: T.let[T.int32] = T.min(
                                            T.Cast("int32", t * T.float32(PER_T)), BUCKETS - 1
                                        )
                                        add(hs, lo, hi, d, wt, key_of(xs[u]))
                        else:
                            if s == 0 and tx == 0:  # the next kernel starts from this cut
                                for i in T.serial(CUT):
                                    cut[b, q - 1, i] = found[i]
                            rng[0] = T.Cast("uint32", found[2])
                            rng[1] = T.Cast("uint32", found[3])
                            rng[2] = shift(rng[1] - rng[0])
                            if rng[0] < rng[1]:
                                for st in T.serial(T.Select(on, steps, 0)):
                                    load(logits, r, s * nt + tx, st, xs)
                                    for u in T.unroll(per):
                                        key: T.let[T.uint32] = key_of(xs[u])
                                        if key >= rng[0] and key <= rng[1]:
                                            d: T.let[T.int32] = T.Cast("int32", T.shift_right(
                                                rng[1] - key, rng[2]))  # fmt: skip
                                            wt: T.let[T.float64] = weight((m[0] - xs[u]) * c)
                                            add(hs, lo, hi, d, wt, key)
                flush(hs, lo, hi, hist, keys, b, q, on)

    @T.macro
    def last_cut(floats, ints, floor, hist, keys, cut, n):
        for b in grid(n):
            with T.sblock("nucleus_floor"):
                T.reads()
                T.writes()
                hs = T.sblock_alloc_buffer((BUCKETS,), "float64", scope=shared)
                sums = T.sblock_alloc_buffer((wl,), "float64", scope=shared)
                prev = T.sblock_alloc_buffer((CUT,), "float64", scope=shared)
                found = T.sblock_alloc_buffer((CUT,), "float64", scope=shared)
                T.evaluate(wait_for_producers(gpu))
                T.evaluate(release_dependents(gpu))
                on: T.let[T.bool] = wants_floor(floats, ints, b)
                crossing(hist, keys, cut, floats, hs, sums, prev, found, b, KEY_ROUNDS, on)
                for tx in lanes():
                    with T.sblock("floor"):
                        T.reads()
                        T.writes()
                        if tx == 0:
                            floor[b] = T.Select(on, value_of(T.Cast("uint32", found[2])), NONE)

    @T.macro
    def floors(logits, rows_buf, floats, ints, floor, peak, hist, keys, cut, n):
        peaks(logits, rows_buf, floats, ints, peak, hist, keys, n)
        histogram(logits, rows_buf, floats, ints, peak, hist, keys, cut, n, 0)
        histogram(logits, rows_buf, floats, ints, peak, hist, keys, cut, n, 1)
        histogram(logits, rows_buf, floats, ints, peak, hist, keys, cut, n, 2)
        histogram(logits, rows_buf, floats, ints, peak, hist, keys, cut, n, 3)
        last_cut(floats, ints, floor, hist, keys, cut, n)

    return floors
