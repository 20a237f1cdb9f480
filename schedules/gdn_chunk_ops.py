"""Building blocks of the chunked GDN's two tensor-core passes (gdn_chunk_prep,
gdn_chunk_scan): one warp's bf16 matmul on swizzled shared tiles, the chunk's cumulative
decays, and conv inputs read from in_proj's rows or the slot's history."""

from __future__ import annotations

from tvm.script import tirx as T

from .gdn_mma_tiles import a_lane, b_lane, swz
from .gdn_prep import log_decay
from .ptx import ldmatrix_x4, mma_bf16

FULL_MASK = 0xFFFFFFFF


@T.macro
def warp_mm(
    a, a_at, a_width, a_km, b, b_at, b_width, b_kn, acc, af, bf, mt, n0, ng, k_steps, lane
):
    # acc[: 4 ng] += A[16 rows at m tile mt, : 16 k_steps] x B[:, n8 tiles n0 .. n0 + ng), one
    # warp: A stored [m][k] or, a_km, [k][m] in the swizzled tile at a_at of `a`; B as [n][k]
    # or, b_kn, [k][n]
    for kk in T.unroll(k_steps):
        ar, ac = T.meta_var(a_lane(lane, kk, a_km))
        if a_km:
            T.evaluate(ldmatrix_x4(af, 0, a, a_at + swz(ar, mt * 16 + ac, a_width), True))
        else:
            T.evaluate(ldmatrix_x4(af, 0, a, a_at + swz(mt * 16 + ar, ac, a_width)))
        for np_ in T.unroll(ng // 2):
            br, bc = T.meta_var(b_lane(lane, kk, b_kn))
            if b_kn:
                T.evaluate(ldmatrix_x4(
                    bf, 0, b, b_at + swz(br, (n0 + np_ * 2) * 8 + bc, b_width), True
                ))  # fmt: skip
            else:
                T.evaluate(ldmatrix_x4(
                    bf, 0, b, b_at + swz((n0 + np_ * 2) * 8 + br, bc, b_width)
                ))  # fmt: skip
            for h2 in T.unroll(2):
                T.evaluate(mma_bf16(af.data, 0, bf.data, h2 * 4, acc.data, (np_ * 2 + h2) * 4))


@T.macro
def decay_scan(x, a_col, a_log, dt_bias, gs, gc, cum, gv, t0, nv, h, row0, warp, lane, c: int):
    # G = cumsum of the chunk's log decays g (from in_proj's a at column a_col; 0 past the
    # chunk's end, so G stays at its last value there): 32 tokens a piece, an inclusive
    # Hillis-Steele scan over the lanes plus the pieces before; warp w stores piece w. One load
    # a lane, not a chain of C dependent loads.
    cum[0] = T.float32(0)
    for piece in T.unroll(-(-c // 32)):
        j: T.let[T.int32] = piece * 32 + lane
        g = T.meta_var(log_decay(
            T.Cast("float32", x[t0 + T.min(j, nv - 1), a_col]), a_log[h], dt_bias[h]
        ))  # fmt: skip
        gv[0] = T.Select(j < nv, g, T.float32(0))
        for s in T.unroll(5):
            gv[1] = T.tvm_warp_shuffle_up(FULL_MASK, gv[0], 1 << s, 32, 32)
            gv[0] = gv[0] + T.Select(lane >= (1 << s), gv[1], T.float32(0))
        gv[0] = gv[0] + cum[0]
        cum[0] = T.tvm_warp_shuffle(FULL_MASK, gv[0], 31, 32, 32)
        if piece == warp and j < c:
            gs[j] = gv[0]
            gc[h, row0 + j] = gv[0]


def conv_input(x, pool, ch, t, t0, nv, seq, layer, hist: int, n_tok, history: bool):
    """Channel ch's conv input at token t of the chunk starting at t0 (nv tokens) of the
    sequence (first token, slot) = seq: a row of x, or, for t < 0 (`history`) before the
    sequence's first token, its slot's conv history. Both loads are made and one is selected
    (a branch would put each load behind its own test); indices clamp, so every load is in
    bounds whatever the chunk."""
    row = T.Cast("float32", x[T.max(T.min(t0 + T.min(t, nv - 1), n_tok - 1), 0), ch])
    if not history:
        return row
    s = t0 - seq[0] + t  # the token's place in its sequence
    return T.Select(
        s >= 0, row, T.Cast("float32", pool[seq[1], layer, ch, T.min(T.max(hist + s, 0), hist - 1)])
    )


@T.macro
def conv_window(x, pool, dst, ch, first, count, t0, nv, seq, layer, n_tok, hist, c, interior):
    # channel ch's conv inputs at chunk tokens first .. first + hist + count - 1 (the first
    # hist may fall before the chunk) into dst. With `interior`, a full chunk of c tokens whose
    # history is its sequence's own rows (all but a sequence's first and last) loads them as
    # they are: no clamp and no conv-history select a load.
    if interior and T.And(nv == c, t0 - seq[0] >= hist):  # block-uniform
        for i in T.unroll(hist + count):
            dst[i] = T.Cast("float32", x[t0 + first + i, ch])
    else:
        for i in T.unroll(hist):
            dst[i] = conv_input(x, pool, ch, first + i, t0, nv, seq, layer, hist, n_tok, True)
        for i in T.unroll(count):
            dst[hist + i] = conv_input(x, pool, ch, first + hist + i, t0, nv, seq, layer, hist,
                                       n_tok, False)  # fmt: skip
