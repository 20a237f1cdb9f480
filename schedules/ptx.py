"""The tensor-core instructions our bf16 kernels issue, written once for all of them."""

from __future__ import annotations

import tvm
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


def cp_async_16(dst, dst_offset, src, src_offset, live=None):
    """cp.async.cg of 16 bytes (8 bf16, offsets in elements) from global `src` to shared `dst`,
    cached in L2 only; where `live` is false, nothing is read and the 16 bytes are zeroed."""
    call = T.s_tir.cp_async_raw.legacy(dst, dst_offset, src, src_offset, 16, dtype="bfloat16")
    if live is None:
        return call
    # a Select, not a Cast: TVM's codegen reads a Cast's `.value` as a constant predicate
    pred = T.Select(live, T.int32(1), T.int32(0))
    return tvm.ir.Call(call.op, [*call.args, pred], ret_ty=call.ty)
