"""The greedy pick's arithmetic, shared by its kernels (schedules/greedy.py) and the logits
kernel that makes its first half (schedules/logits_mma.py): a run of columns reduces to a
triple (max, first index of the max, sum of exp(x - max)), and triples merge in any order
into the triple of their union. Ties go to the lower id, as numpy's argmax does, and -inf (a
pad or forbidden column, or a run that saw none) neither wins nor adds to the sum."""

from __future__ import annotations

from tvm.script import tirx as T

FULL_MASK = 0xFFFFFFFF


def term(x, m):
    """exp(x - m) with exp(-inf - -inf) = 0 (a part that saw no live column)."""
    return T.Select(x == T.float32("-inf"), T.float32(0), T.exp(x - m))


@T.macro
def merge(run, arg, om, oi, osum):
    """run[0] max, run[1] sum, arg[0] index: merged with the triple (om, oi, osum). One column
    x at c merges as (x, c, 1)."""
    top: T.let[T.float32] = T.max(run[0], om)
    better: T.let[T.bool] = om > run[0] or (om == run[0] and oi < arg[0])
    run[1] = run[1] * term(run[0], top) + osum * term(om, top)
    arg[0] = T.Select(better, oi, arg[0])
    run[0] = top


@T.macro
def take(run, arg, x, c):
    """merge(run, arg, x, c, 1) for columns taken in ascending c: one exp, not two (the first
    max stays)."""
    if x > run[0]:
        run[1] = run[1] * term(run[0], x) + T.float32(1)
        run[0] = x
        arg[0] = c
    else:
        run[1] = run[1] + term(x, run[0])


@T.macro
def warp_merge(run, arg, lowest: int, steps: int):
    """Merge the triples of lanes that differ in lane bits lowest << 0 .. lowest << steps-1:
    after it each of them holds their merged triple. GPU only."""
    for s in T.unroll(steps):
        om: T.let[T.float32] = T.tvm_warp_shuffle_xor(FULL_MASK, run[0], lowest << s, 32, 32)
        oi: T.let[T.int32] = T.tvm_warp_shuffle_xor(FULL_MASK, arg[0], lowest << s, 32, 32)
        osum: T.let[T.float32] = T.tvm_warp_shuffle_xor(FULL_MASK, run[1], lowest << s, 32, 32)
        merge(run, arg, om, oi, osum)


@T.macro
def start(run, arg):
    run[0] = T.float32("-inf")
    run[1] = T.float32(0)
    arg[0] = 0


@T.macro
def reduce_shared(vals, ids, sums, lanes_, width):
    """A block's `width` triples (row 0 of the [2, width] shared buffers) to slot 0 of row
    (log2 width) % 2. Ping-pong between two rows: step s reads row s % 2 and every lane writes
    only its own slot of the other, so no lane reads what another writes. Lanes past the live
    half compute values nobody reads."""
    for s in T.serial(width.bit_length() - 1):
        for tx in lanes_():
            with T.sblock("reduce"):
                T.reads()
                T.writes()
                # TVM's sync pass wants shared loads outside conditions.
                o: T.let[T.int32] = T.min(tx + T.shift_right(width, s + 1), width - 1)
                om: T.let[T.float32] = vals[s % 2, o]
                oi: T.let[T.int32] = ids[s % 2, o]
                osum: T.let[T.float32] = sums[s % 2, o]
                cm: T.let[T.float32] = vals[s % 2, tx]
                ci: T.let[T.int32] = ids[s % 2, tx]
                cs: T.let[T.float32] = sums[s % 2, tx]
                better: T.let[T.bool] = om > cm or (om == cm and oi < ci)
                top: T.let[T.float32] = T.max(om, cm)
                vals[1 - s % 2, tx] = top
                ids[1 - s % 2, tx] = T.Select(better, oi, ci)
                sums[1 - s % 2, tx] = cs * term(cm, top) + osum * term(om, top)


def last_row(width: int) -> int:
    """The row of reduce_shared's result."""
    return (width.bit_length() - 1) % 2


# The plain pick's chunk: the logits kernel's block of columns (schedules/logits_mma.py), whose
# triple it writes beside its logits
CHUNK_COLS = 128


def pick_chunks(selection: int) -> int:
    """Chunks of a logits row of `selection` columns, the last one partial."""
    return -(-selection // CHUNK_COLS)


@T.macro
def warps_triples(run, arg, tw, tx, gpu: bool):
    """Each warp's (max, sum of exp) triple, merged by shuffles, into tw[warp] (the CPU's one
    lane writes its own)."""
    if gpu:
        warp_merge(run, arg, 1, 5)
    if tx % 32 == 0:
        tw[tx // 32, 0] = run[0]
        tw[tx // 32, 1] = run[1]


@T.macro
def merged_warps(run, arg, tw, warps: int):
    """run = the merge of the warps' triples tw (one thread)."""
    start(run, arg)
    for w in T.serial(warps):
        merge(run, arg, tw[w, 0], 0, tw[w, 1])
