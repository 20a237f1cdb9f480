"""A top_p row's nucleus on the device, whatever its size: the floor its logits must reach.

schedules/sample_pick.py draws top_k rows from their k best, so top_p alone (the common
OpenAI-client setting) had no list to cut and went to the host. Here a block a row finds the
smallest most-likely set holding top_p of the tempered mass, as the value of its least likely
member; sample_pick's Gumbel-max then draws over the columns at or above it, an exact draw from
the renormalised nucleus.

No sort. A column's weight is exp2(-t), t = (peak - x) * log2(e) / temperature, in fixed point
(floor(weight * 2^32), integers held in float64): every sum is exact, so the float64 atomics
that build histograms give the same totals in any order, and a seeded draw stays the same
whatever the launch. Columns 32 or more binary orders below the peak weigh 0, so the nucleus's
mass is exact to a unit a column (at 248,077 columns, 6e-5 of the peak's weight). The first pass
finds the peak; the second histograms the weights by t into BUCKETS buckets (0 = the largest
values) and finds the bucket where the running mass from the top reaches top_p * total; later
passes split that bucket by the logits' order-preserving uint32 keys, BITS at a time, until
one value is left. Every member's columns are kept, ties with the last member included (the
host's sampler keeps the lower ids of a tie cut through; the two differ only there).
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

THREADS = 1024
UNROLL, VEC = 4, 4  # a thread's loads a step, of VEC columns each (16 bytes)
BITS = 11
BUCKETS = 1 << BITS
FIXED = 2.0**32  # a weight's unit: 2^-32 of the peak's
PER_T = BUCKETS / 32.0  # buckets a unit of t: weights past t = 32 are 0
KEY_ROUNDS = 3  # 11 + 11 + 10 bits: a bucket of keys always ends as one value
LOG2E = math.log2(math.e)
NONE = T.float32("-inf")  # the floor of a row without a nucleus to find


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


def nucleus_floors(decodable: int, selection: int, gpu: bool):
    """A macro (logits, rows, floats, ints, floor, n): floor[i] = the smallest logit in row
    rows[i]'s nucleus where its settings ask for top_p without top_k (ints[i, 0] < 1,
    floats[i, 1] < 1), else -inf."""
    if decodable * FIXED >= 2.0**53:
        raise ValueError(f"{decodable} columns: their fixed-point sums would not be exact")
    nt = THREADS if gpu else 1
    wl = 32 if gpu else 1  # lanes of the scan: warp 0 (the CPU's one lane)
    warps = nt // 32 if gpu else 1
    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)
    shared = "shared" if gpu else "global"
    vec = VEC if selection % VEC == 0 else 1  # a row's vectors then all lie inside it
    per = UNROLL * vec  # a thread's columns a step
    steps = -(-decodable // (nt * per))
    per_scan = BUCKETS // wl

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

    @T.macro
    def load(logits, r, tx, s, xs):
        # xs[u * vec + v] = column ((s * UNROLL + u) * nt + tx) * vec + v, -inf past the
        # decodable: a step's vectors all issued before any is used
        for u in T.unroll(UNROLL):
            c0: T.let[T.int32] = ((s * UNROLL + u) * nt + tx) * vec
            for v in T.vectorized(vec):
                xs[u * vec + v] = logits[r, T.min(c0, selection - vec) + v]
        for e in T.unroll(per):
            col: T.let[T.int32] = ((s * UNROLL + e // vec) * nt + tx) * vec + e % vec
            xs[e] = T.Select(col < decodable, xs[e], NONE)

    @T.macro
    def row_peak(m, peaks):
        m[0] = NONE
        for w in T.serial(warps):
            m[0] = T.max(m[0], peaks[w])

    @T.macro
    def add(hist, lo, hi, d, w, key):
        if gpu:
            T.evaluate(T.cuda.atomic_add(T.address_of(hist[d]), w))
            T.evaluate(T.call_extern("uint32", "atomicMin", T.address_of(lo[d]), key))
            T.evaluate(T.call_extern("uint32", "atomicMax", T.address_of(hi[d]), key))
        else:
            hist[d] = hist[d] + w
            lo[d] = T.min(lo[d], key)
            hi[d] = T.max(hi[d], key)

    @T.macro
    def cleared(hist, lo, hi, tx, on):
        for e in T.serial(T.Select(on, -(-BUCKETS // nt), 0)):
            d: T.let[T.int32] = e * nt + tx
            if d < BUCKETS:
                hist[d] = T.float64(0)
                lo[d] = T.uint32(0xFFFFFFFF)
                hi[d] = T.uint32(0)

    @T.macro
    def crossing(hist, lo, hi, sums, st, keys, found, found_keys, on):
        # the bucket where the running mass from bucket 0 reaches st[1] (top_p * total), st[0]
        # the mass above bucket 0: each lane sums its run of buckets, and the lane whose run
        # holds the crossing walks it, leaving the mass above the bucket and its keys' range
        for ln in lanes():
            with T.sblock("lane_sums"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((1,), "float64", scope="local")
                if ln < wl:
                    acc[0] = T.float64(0)
                    for i in T.serial(T.Select(on, per_scan, 0)):
                        acc[0] = acc[0] + hist[ln * per_scan + i]
                    sums[ln] = acc[0]
        for ln in lanes():
            with T.sblock("walk"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((3,), "float64", scope="local")
                at = T.sblock_alloc_buffer((1,), "int32", scope="local")
                if ln < wl:
                    acc[0] = st[0]
                    for q in T.serial(wl):
                        acc[0] = acc[0] + T.Select(q < ln, sums[q], T.float64(0))
                    acc[1] = sums[ln]
                    acc[2] = st[1]
                    if acc[0] < acc[2] and acc[0] + acc[1] >= acc[2]:
                        at[0] = -1
                        for i in T.serial(per_scan):
                            acc[1] = hist[ln * per_scan + i]
                            if at[0] < 0:
                                if acc[0] + acc[1] >= acc[2]:
                                    at[0] = ln * per_scan + i
                                else:
                                    acc[0] = acc[0] + acc[1]
                        found[0] = acc[0]
                        found_keys[0] = lo[at[0]]
                        found_keys[1] = hi[at[0]]
        for ln in lanes():
            with T.sblock("take"):
                T.reads()
                T.writes()
                if ln == 0:  # (the walk reads st: it cannot also write it)
                    st[0] = found[0]
                    keys[0] = found_keys[0]
                    keys[1] = found_keys[1]

    @T.macro
    def floors(logits, rows_buf, floats, ints, floor, n):
        for b in grid(n):
            with T.sblock("nucleus"):
                T.reads()
                T.writes()
                hist = T.sblock_alloc_buffer((BUCKETS,), "float64", scope=shared)
                lo = T.sblock_alloc_buffer((BUCKETS,), "uint32", scope=shared)
                hi = T.sblock_alloc_buffer((BUCKETS,), "uint32", scope=shared)
                part = T.sblock_alloc_buffer((max(warps, wl),), "float64", scope=shared)
                peaks = T.sblock_alloc_buffer((warps,), "float32", scope=shared)
                st = T.sblock_alloc_buffer((2,), "float64", scope=shared)  # above, target
                keys = T.sblock_alloc_buffer((2,), "uint32", scope=shared)  # a bucket's range
                found = T.sblock_alloc_buffer((1,), "float64", scope=shared)
                found_keys = T.sblock_alloc_buffer((2,), "uint32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                r: T.let[T.int32] = rows_buf[b]
                c: T.let[T.float32] = T.float32(LOG2E) / floats[b, 0]
                # a row with nothing to find runs every pass over no columns (no branch
                # around them: barriers cannot sit in one)
                on: T.let[T.bool] = ints[b, 0] < 1 and floats[b, 1] < T.float32(1)
                passes: T.let[T.int32] = T.Select(on, steps, 0)
                for tx in lanes():
                    with T.sblock("peak"):
                        T.reads()
                        T.writes()
                        xs = T.sblock_alloc_buffer((per,), "float32", scope="local")
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        m[0] = NONE
                        for s in T.serial(passes):
                            load(logits, r, tx, s, xs)
                            for u in T.unroll(per):
                                m[0] = T.max(m[0], xs[u])
                        if gpu:
                            for sh in T.unroll(5):
                                m[0] = T.max(m[0], T.tvm_warp_shuffle_xor(
                                    0xFFFFFFFF, m[0], 1 << sh, 32, 32))  # fmt: skip
                        if tx % 32 == 0:
                            peaks[tx // 32] = m[0]
                        cleared(hist, lo, hi, tx, on)
                for tx in lanes():
                    with T.sblock("weigh"):
                        T.reads()
                        T.writes()
                        # bucket by t, the weights' total in every thread's part
                        xs = T.sblock_alloc_buffer((per,), "float32", scope="local")
                        m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        tot = T.sblock_alloc_buffer((1,), "float64", scope="local")
                        row_peak(m, peaks)
                        tot[0] = T.float64(0)
                        for s in T.serial(passes):
                            load(logits, r, tx, s, xs)
                            for u in T.unroll(per):
                                t: T.let[T.float32] = (m[0] - xs[u]) * c
                                wt: T.let[T.float64] = weight(t)
                                if wt > T.float64(0):
                                    d: T.let[T.int32] = T.min(
                                        T.Cast("int32", t * T.float32(PER_T)), BUCKETS - 1
                                    )
                                    add(hist, lo, hi, d, wt, key_of(xs[u]))
                                    tot[0] = tot[0] + wt
                        if gpu:
                            for sh in T.unroll(5):
                                tot[0] = tot[0] + T.tvm_warp_shuffle_xor(
                                    0xFFFFFFFF, tot[0], 1 << sh, 32, 32)  # fmt: skip
                        if tx % 32 == 0:
                            part[tx // 32] = tot[0]
                for tx in lanes():
                    with T.sblock("target"):
                        T.reads()
                        T.writes()
                        tot = T.sblock_alloc_buffer((1,), "float64", scope="local")
                        if tx == 0:
                            keys[0] = T.uint32(0)  # a row without a nucleus keeps these
                            keys[1] = T.uint32(0)
                            found[0] = T.float64(0)
                            found_keys[0] = T.uint32(0)
                            found_keys[1] = T.uint32(0)
                            tot[0] = T.float64(0)
                            for w in T.serial(warps):
                                tot[0] = tot[0] + part[w]
                            st[0] = T.float64(0)
                            st[1] = T.Cast("float64", floats[b, 1]) * tot[0]
                crossing(hist, lo, hi, part, st, keys, found, found_keys, on)
                for _ in T.serial(T.Select(on, KEY_ROUNDS, 0)):
                    # the bucket's keys, split from its largest (bucket 0) down
                    for tx in lanes():
                        with T.sblock("clear"):
                            T.reads()
                            T.writes()
                            cleared(hist, lo, hi, tx, on)
                    for tx in lanes():
                        with T.sblock("split"):
                            T.reads()
                            T.writes()
                            xs = T.sblock_alloc_buffer((per,), "float32", scope="local")
                            rng = T.sblock_alloc_buffer((3,), "uint32", scope="local")
                            m = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            row_peak(m, peaks)
                            rng[0] = keys[0]
                            rng[1] = keys[1]
                            rng[2] = shift(rng[1] - rng[0])
                            if rng[0] < rng[1]:
                                for s in T.serial(passes):
                                    load(logits, r, tx, s, xs)
                                    for u in T.unroll(per):
                                        key: T.let[T.uint32] = key_of(xs[u])
                                        if key >= rng[0] and key <= rng[1]:
                                            d: T.let[T.int32] = T.Cast("int32", T.shift_right(
                                                rng[1] - key, rng[2]))  # fmt: skip
                                            wt: T.let[T.float64] = weight((m[0] - xs[u]) * c)
                                            add(hist, lo, hi, d, wt, key)
                    crossing(hist, lo, hi, part, st, keys, found, found_keys, on)
                for tx in lanes():
                    with T.sblock("floor"):
                        T.reads()
                        T.writes()
                        if tx == 0:
                            floor[b] = T.Select(on, value_of(keys[0]), NONE)

    return floors
