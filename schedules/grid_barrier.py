"""A barrier across a kernel's whole grid, and the probe that weighs it against a kernel boundary.

A b1 decode step is ~180 kernels in a chain, and each costs ~2-3 µs beyond its bytes whatever
its shape (docs/performance.md, session 9): the producer's last block, the memory flush, the
dependent grid's release, then the ramp of its first loads. A persistent kernel would run such
steps as phases of one grid, each block waiting at a grid barrier for every block's outputs of
the phase before, and it may issue the next phase's weight loads (constant data) before it
waits. Whether that wins is a number this module lets the GPU give (benchmarks/grid_chain.py).

The barrier: thread 0 of each block publishes the block's writes (a fence), counts its arrival
in `words[0]` and polls it (relaxed loads, one acquire at the end: T.cuda.wait_until) until
every block of the grid has arrived at this phase, (phase + 1) x blocks arrivals; the block's
other threads wait for thread 0 at a block barrier. It is sound only where every block of the
grid is resident at once (a grid of at most SMs x blocks-per-SM). After its last barrier each
block counts its exit in `words[1]`, and the last to leave zeroes both words: every other block
has passed every wait by then, and the next kernel to use them waits for this one first
(schedules/pdl.py). The words are zero between kernels, like decode's GDN tickets.

The probe, `streaming_phases`: P phases; in each, block b sums its slice of that phase's
int32 data (128-bit loads) and adds out[p - 1, (b + 1) % blocks], another block's result of
the phase before, so a missing or early barrier changes the answer. `fused` runs the phases in
one kernel with the barrier between them; otherwise the kernel runs phase `phase` only and a
chain of launches (waiting for its producer, schedules/pdl.py) plays the phases. Both load the
first `ahead` vectors of a thread's slice before they wait (the data is constant), as a
decode GEMV prefetches its weight. The CPU form runs the same phases as one loop nest each.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .pdl import release_dependents, wait_for_producers

WORDS = 2  # arrivals, exits
VEC = 4  # int32 lanes of a 128-bit load
THREADS = 256
FULL_MASK = 0xFFFFFFFF


@T.macro
def grid_barrier(words, seen, tx, target):
    """Every block's writes before this point are visible to every block after it, once
    `target` blocks in all have arrived (GPU only; `seen`: a local int32 scalar buffer)."""
    T.tvm_storage_sync("shared")
    if tx == 0:
        T.evaluate(T.cuda.thread_fence())
        T.evaluate(T.cuda.atomic_add(T.address_of(words[0]), 1))
        T.evaluate(T.cuda.wait_until(seen, T.address_of(words[0]), lambda v: v >= target))
    T.tvm_storage_sync("shared")


@T.macro
def grid_exit(words, ticket, tx, blocks):
    """After a block's last barrier: the last block to leave zeroes the words (GPU only;
    `ticket`: a local int32 scalar buffer)."""
    if tx == 0:
        ticket[0] = T.cuda.atomic_add(T.address_of(words[1]), 1)
        if ticket[0] == blocks - 1:
            words[0] = 0
            words[1] = 0


def streaming_phases(
    phases: int, blocks: int, per_thread: int, gpu: bool, fused: bool, ahead: int = 8
) -> tirx.PrimFunc:
    """The probe (see the module docstring): data [phases, blocks, per_thread, THREADS * VEC]
    int32, out [phases, blocks] int32, and words [WORDS] int32 (fused) or the phase (an int32
    scalar, first)."""
    if not (phases >= 1 and blocks >= 1 and per_thread >= 0 and ahead >= 0):
        raise ValueError(f"phases {phases}, blocks {blocks}, per_thread {per_thread}")
    ahead = min(ahead, per_thread)
    # a thread's i-th vector beside its neighbours': a warp's load is 512 contiguous bytes
    shape = (phases, blocks, per_thread, THREADS * VEC)
    slots = max(ahead, 1) * VEC  # a thread's registers of loads ahead

    @T.macro
    def load_ahead(data, regs, r0, p, b, tx):
        for i in T.unroll(ahead):
            for v in T.vectorized(VEC):
                regs[r0 + i * VEC + v] = data[p, b, i, tx * VEC + v]

    @T.macro
    def thread_sum(data, regs, r0, mine, p, b, tx):
        # the thread's slice: `ahead` vectors loaded before the wait, the rest now
        acc = T.sblock_alloc_buffer((VEC,), "int32", scope="local")
        for v in T.vectorized(VEC):
            acc[v] = 0
        for i in T.unroll(ahead):
            for v in T.vectorized(VEC):
                acc[v] = acc[v] + regs[r0 + i * VEC + v]
        for i in T.unroll(ahead, per_thread):
            for v in T.vectorized(VEC):
                acc[v] = acc[v] + data[p, b, i, tx * VEC + v]
        mine[0] = acc[0] + acc[1] + acc[2] + acc[3]

    @T.macro
    def block_store(out, part, p0, count, p, b):
        # thread 0's: the block's sum plus another block's result of the phase before
        total = T.sblock_alloc_buffer((1,), "int32", scope="local")
        total[0] = T.if_then_else(p > 0, out[T.max(p - 1, 0), (b + 1) % blocks], 0)
        for t in T.serial(count):
            total[0] = total[0] + part[p0 + t]
        out[p, b] = total[0]

    @T.macro
    def cpu_phase(data, out, p):
        # a loop nest a phase: the CPU's barrier
        regs = T.sblock_alloc_buffer((blocks * THREADS * slots,), "int32")
        part = T.sblock_alloc_buffer((blocks * THREADS,), "int32")
        for b, tx in T.grid(blocks, THREADS):
            with T.sblock("sum"):
                T.reads()
                T.writes()
                mine = T.sblock_alloc_buffer((1,), "int32")
                r0: T.let[T.int32] = (b * THREADS + tx) * slots
                load_ahead(data, regs, r0, p, b, tx)
                thread_sum(data, regs, r0, mine, p, b, tx)
                part[b * THREADS + tx] = mine[0]
        for b in T.serial(blocks):
            with T.sblock("store"):
                T.reads()
                T.writes()
                block_store(out, part, b * THREADS, THREADS, p, b)

    if not gpu:

        @T.prim_func(s_tir=True)
        def cpu_phases(
            data: T.Buffer(shape, "int32"),
            out: T.Buffer((phases, blocks), "int32"),
            words: T.Buffer((WORDS,), "int32"),
        ):
            for p in T.serial(phases):
                cpu_phase(data, out, p)

        @T.prim_func(s_tir=True)
        def cpu_one(
            phase: T.int32,
            data: T.Buffer(shape, "int32"),
            out: T.Buffer((phases, blocks), "int32"),
        ):
            cpu_phase(data, out, phase)

        return cpu_phases if fused else cpu_one

    @T.macro
    def gpu_body(data, out, regs, part, p, b, tx):
        mine = T.sblock_alloc_buffer((1,), "int32", scope="local")
        thread_sum(data, regs, 0, mine, p, b, tx)
        for i in T.unroll(5):  # a warp's sum by shuffles, then the warps' in shared memory
            mine[0] = mine[0] + T.tvm_warp_shuffle_xor(FULL_MASK, mine[0], 1 << i, 32, 32)
        if tx % 32 == 0:
            part[tx // 32] = mine[0]
        T.tvm_storage_sync("shared")
        if tx == 0:
            block_store(out, part, 0, THREADS // 32, p, b)

    @T.prim_func(s_tir=True)
    def gpu_phases(
        data: T.Buffer(shape, "int32"),
        out: T.Buffer((phases, blocks), "int32"),
        words: T.Buffer((WORDS,), "int32"),
    ):
        for b in T.thread_binding(blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("phases"):
                    T.reads()
                    T.writes()
                    regs = T.sblock_alloc_buffer((slots,), "int32", scope="local")
                    part = T.sblock_alloc_buffer((THREADS,), "int32", scope="shared")
                    seen = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    load_ahead(data, regs, 0, 0, b, tx)
                    T.evaluate(wait_for_producers(True))
                    T.evaluate(release_dependents(True))
                    for p in T.serial(phases, annotations={"disable_unroll": 1}):
                        gpu_body(data, out, regs, part, p, b, tx)
                        if p + 1 < phases:  # the next phase's first loads, then the wait
                            load_ahead(data, regs, 0, p + 1, b, tx)
                        grid_barrier(words, seen, tx, (p + 1) * blocks)
                    grid_exit(words, seen, tx, blocks)

    @T.prim_func(s_tir=True)
    def gpu_one(
        phase: T.int32,
        data: T.Buffer(shape, "int32"),
        out: T.Buffer((phases, blocks), "int32"),
    ):
        for b in T.thread_binding(blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("phase"):
                    T.reads()
                    T.writes()
                    regs = T.sblock_alloc_buffer((slots,), "int32", scope="local")
                    part = T.sblock_alloc_buffer((THREADS,), "int32", scope="shared")
                    load_ahead(data, regs, 0, phase, b, tx)  # constant data: before the wait
                    T.evaluate(wait_for_producers(True))
                    T.evaluate(release_dependents(True))
                    gpu_body(data, out, regs, part, phase, b, tx)

    return gpu_phases if fused else gpu_one
