"""The tensor-core instructions our bf16 kernels issue, written once for all of them."""

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


def ldmatrix_x4(frag, frag_offset, shared, offset, trans: bool = False):
    """ldmatrix.x4: four 8x8 bf16 matrices from `shared` at element `offset` (each lane gives
    one row's address) into 8 elements of `frag` at `frag_offset`; `trans` hands each lane
    columns instead of rows (a [k, n] operand read as mma's col-major B)."""
    return T.ptx_legacy.ldmatrix(
        trans, 4, ".b16", frag.data, frag_offset, shared.access_ptr("r"), offset, dtype="bfloat16"
    )
