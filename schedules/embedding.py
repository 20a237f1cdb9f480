"""A decode step's first kernel: the token embedding gather, reading the step record.

A decode step gets its inputs as one int32 record a row, `step` [batch, 3] = (token, slot,
position): one host-to-device copy, or none when greedy.feed_picks wrote it on the device.
Relax made five kernels of its start (three splits, an arange for the ragged indptr, the
embedding take); here it is one, which gathers each row's embedding and unpacks the record
into the slots, positions and indptr the layers read.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

LANES = 128


def decode_inputs(hidden: int, dtype: str, target: Target) -> PrimFunc:
    """(step [batch, 3], embedding table [rows, hidden]) -> (x [batch, hidden], indptr
    [batch + 1] = 0..batch, slots [batch], positions [batch]). A block copies LANES vectors of
    a row's embedding; the first block of each row also unpacks that row's record."""
    gpu = target.kind.name == "cuda"
    size = 2 if dtype == "bfloat16" else 4
    vec = next(v for v in (8, 4, 2, 1) if v * size <= 16 and hidden % v == 0)  # <= 128-bit
    per_row = -(-(hidden // vec) // LANES)  # blocks a row
    grid, lanes = block_loop(gpu), thread_loop(LANES, gpu)

    @T.prim_func(s_tir=True)
    def decode_inputs_fn(
        step_h: T.handle,
        table_h: T.handle,
        x_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pos_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch, rows = T.int32(), T.int32()
        step = T.match_buffer(step_h, (batch, 3), "int32")
        table = T.match_buffer(table_h, (rows, hidden), dtype)
        x = T.match_buffer(x_h, (batch, hidden), dtype)
        indptr = T.match_buffer(indptr_h, (batch + 1,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        pos = T.match_buffer(pos_h, (batch,), "int32")
        for blk in grid(batch * per_row):
            for tx in lanes():
                with T.sblock("gather"):
                    T.reads()
                    T.writes()
                    T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                    T.evaluate(release_dependents(gpu))
                    b: T.let[T.int32] = blk // per_row
                    v: T.let[T.int32] = blk % per_row * LANES + tx
                    if v < hidden // vec:
                        for i in T.vectorized(vec):
                            x[b, v * vec + i] = table[step[b, 0], v * vec + i]
                    if v == 0:
                        slots[b] = step[b, 1]
                        pos[b] = step[b, 2]
                        indptr[b + 1] = b + 1
                        if b == 0:
                            indptr[0] = 0

    return decode_inputs_fn.with_attr("global_symbol", "decode_inputs")
