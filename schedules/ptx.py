"""The tensor-core instructions our bf16 kernels issue, written once for all of them."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .sm90a import SM90A_FN


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


# ---- sm_90a: wgmma ---------------------------------------------------------------------------


def is_sm90a():
    """True in the code nvcc builds for sm_90a (schedules/sm90a.py)."""
    return T.call_pure_extern("bool", SM90A_FN)


def wgmma_desc_sw128(address):
    """The wgmma shared-memory descriptor of a K-major bf16 tile stored in 128-byte rows with
    the 128-byte swizzle, from the 32-bit shared address of its first row (1,024-byte aligned,
    plus 32 bytes per k16 step): 8-row groups 1,024 bytes apart (the stride offset), the
    leading offset unused by swizzled K-major tiles (1, as CUTLASS sets it)."""
    # stride offset; layout type 1 (128B) at bit 62. One literal: an unfolded shift is a
    # common subexpression that TVM hoists out of a PrimFunc's two GEMM launches into a uint64
    # kernel argument, which its CUDA runtime cannot pass
    hi = T.uint64(((1024 >> 4) | (1 << 30)) << 32)
    lo = T.bitwise_or(
        T.uint32(1 << 16), T.bitwise_and(T.shift_right(address, T.uint32(4)), T.uint32(0x3FFF))
    )
    return T.bitwise_or(hi, T.Cast("uint64", lo))


def wgmma_bf16(acc, a_desc, b_desc, n: int):
    """wgmma.mma_async m64n{n}k16, bf16 A and B from shared memory (descriptors), fp32
    accumulators acc[0 : n / 2] of this thread, D += A·B."""
    op = getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{n}k16").f32.bf16.bf16
    return op(*[acc[i] for i in range(n // 2)], a_desc, b_desc, T.bool(True), 1, 1, 0, 0)
