"""A block of warps streaming weight rows through registers onto a few batch rows with mma.sync:
the sm_80 body of the kernels whose sm_90a body is a wgmma ring with the weight as A (the
logits' wide launch, decode_wide's GEMV: schedules/gemv_wide_mma.py), and the logits' own up to
16 rows. Its accumulators are mma's m16n8 layout, which wgmma's D shares, so the callers'
epilogues serve both bodies."""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T

from .ptx import mma_bf16

Index = int | tirx.Expr


def mma_rows(
    k: int,
    dtype: str,
    warps: int,
    m_tiles: int,
    n_tiles: int,
    weight_row: Callable[[Index, Index], Index],
    live: int | None = None,
):
    """A macro (x, w, acc, batch, bx, ty, tx, b0): warp ty's accumulators over batch pass b0
    (`n_tiles` n8 batch tiles) of block bx's rows, on tensor cores (mma.sync m16n8k16, fp32
    accumulate). A warp owns 16 * m_tiles rows of the block's warps * 16 * m_tiles; block row
    r is weight row `weight_row(bx, r)`, zero where that is `live` or past (None: every row
    is read). Batch rows past the batch read as zeros.

    The dot product does not care in which order k is summed, so each lane loads 8
    consecutive k of a row with one 128-bit load and the same 8 k of the batch row, and those
    8 feed two mma k16 steps: lane (g, q) supplies logical k {2q, 2q+1, 2q+8, 2q+9} of each
    step, which both operands agree to map to physical k 8q' + {0..3} and 8q' + {4..7}. Lane q
    streams k_lane contiguous k of each step, so the four lanes of a row read one contiguous
    stretch; the next step's weight loads are issued before this step's mma (two register
    stages)."""
    unroll = 2
    step = 32 * unroll
    k_lane = 8 * unroll
    if k % (2 * step):
        raise ValueError(f"k {k} must be a multiple of {2 * step}")
    k_pairs = k // (2 * step)
    guard = live is not None

    @T.macro
    def load_w(
        w: T.Buffer, w_reg: T.Buffer, stage: T.int32, ks: T.int32, bx: T.int32, r0: T.int32,
        q: T.int32,
    ):  # fmt: skip
        for u in T.unroll(unroll):
            for h in T.unroll(2 * m_tiles):  # rows r0 + 8h: m-tile h // 2, half h % 2
                row = T.meta_var(weight_row(bx, r0 + h * 8))
                if guard:
                    if row < live:
                        for v in T.vectorized(8):
                            w_reg[stage, u, h, v] = w[row, ks * step + q * k_lane + u * 8 + v]
                    else:
                        for v in T.vectorized(8):
                            w_reg[stage, u, h, v] = T.Cast(dtype, 0)
                else:
                    for v in T.vectorized(8):
                        w_reg[stage, u, h, v] = w[row, ks * step + q * k_lane + u * 8 + v]

    @T.macro
    def mma_step(
        x: T.Buffer,
        w_reg: T.Buffer,
        x_reg: T.Buffer,
        a_frag: T.Buffer,
        b_frag: T.Buffer,
        acc: T.Buffer,
        stage: T.int32,
        ks: T.int32,
        b_base: T.int32,
        batch: T.int32,
        g: T.int32,
        q: T.int32,
    ):
        for u in T.unroll(unroll):
            # the batch tiles' loads are all in flight before the first mma
            for nt in T.unroll(n_tiles):
                if b_base + nt * 8 < batch:
                    if b_base + nt * 8 + g < batch:
                        for v in T.vectorized(8):
                            x_reg[nt, v] = x[
                                b_base + nt * 8 + g, ks * step + q * k_lane + u * 8 + v
                            ]
                    else:
                        for v in T.vectorized(8):
                            x_reg[nt, v] = T.Cast(dtype, 0)
            for m in T.unroll(m_tiles):
                for s in T.unroll(2):
                    # fragment order: (g, k0:2) (g+8, k0:2) (g, k2:4) (g+8, k2:4)
                    for e in T.unroll(8):
                        a_frag[m, s, e] = w_reg[
                            stage, u, m * 2 + (e // 2) % 2, s * 4 + (e // 4) * 2 + e % 2
                        ]
            for nt in T.unroll(n_tiles):
                if b_base + nt * 8 < batch:
                    for e in T.unroll(8):
                        b_frag[e] = x_reg[nt, e]
                    for m in T.unroll(m_tiles):
                        for s in T.unroll(2):
                            T.evaluate(
                                mma_bf16(
                                    a_frag.data,
                                    (m * 2 + s) * 8,
                                    b_frag.data,
                                    s * 4,
                                    acc.data,
                                    (m * n_tiles + nt) * 4,
                                )
                            )

    @T.macro
    def block(x, w, acc, batch, bx, ty, tx, b0):
        w_reg = T.alloc_local((2, unroll, 2 * m_tiles, 8), dtype)
        x_reg = T.alloc_local((n_tiles, 8), dtype)
        # mma operands are addressed by element offset, so they stay plain bf16 arrays; the
        # 128-bit-loaded x_reg is copied in.
        a_frag = T.alloc_local((m_tiles, 2, 8), dtype)
        b_frag = T.alloc_local((8,), dtype)
        g: T.let[T.int32] = tx // 4
        q: T.let[T.int32] = tx % 4
        r0: T.let[T.int32] = ty * 16 * m_tiles + g
        b_base: T.let[T.int32] = b0 * n_tiles * 8
        for i in T.unroll(m_tiles * n_tiles * 4):
            acc[i] = T.float32(0)
        load_w(w, w_reg, 0, 0, bx, r0, q)
        for kp in T.serial(k_pairs):
            load_w(w, w_reg, 1, kp * 2 + 1, bx, r0, q)
            mma_step(x, w_reg, x_reg, a_frag, b_frag, acc, 0, kp * 2, b_base, batch, g, q)
            if kp + 1 < k_pairs:
                load_w(w, w_reg, 0, kp * 2 + 2, bx, r0, q)
            mma_step(x, w_reg, x_reg, a_frag, b_frag, acc, 1, kp * 2 + 1, b_base, batch, g, q)

    return block
