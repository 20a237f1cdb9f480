"""The one tensor-core instruction our bf16 kernels issue, written once for both of them."""

from __future__ import annotations

from tvm.script import tirx as T


def mma_bf16(a, a_offset, b, b_offset, acc, acc_offset):
    """mma.sync m16n8k16, bf16 A (row) x bf16 B (col) + fp32 accumulator, in place: 8 A, 4 B
    and 4 accumulator elements a lane, at the given offsets of the fragments' data."""
    return T.ptx_legacy.mma(
        "m16n8k16",
        "row",
        "col",
        "bf16",
        "bf16",
        "fp32",
        a,
        a_offset,
        b,
        b_offset,
        acc,
        acc_offset,
        False,
        dtype="float32",
    )
