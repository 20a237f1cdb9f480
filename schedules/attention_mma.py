"""What the tensor-core attention kernels share (bf16, sm_80+): a K/V tile's copy into shared
memory, and one tile's step of a warp's online softmax over 16 query rows.

A tile is `tile_pages` pages of keys, copied as stored ([key, dim]) by cp.async: K is mma's
(n, k) operand as is, V is read transposed by `ldmatrix.trans`. Shared rows XOR their 16-byte
chunk with row % 8 (ldmatrix reads 8 rows at one chunk: 8 different banks). Per tile a warp

1. computes S = Q Kᵀ on tensor cores into registers (Q sits in shared memory, 16 rows a warp);
2. runs the online softmax on those registers: a row's 16-key slices live in the 4 lanes of a
   quad, so its max is two shuffles away, and the row sums stay per lane until the end;
3. rounds P to bf16 in place, already laid out as mma's A fragment, so O = alpha O + P V
   follows on tensor cores without touching shared memory.

Scores are in log2 units (the softmax runs on exp2). Used by attention_prefill (a block of
query tokens) and attention_decode_mma (a split piece of one token's keys).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .attention import LOG2E
from .gemm_layout import acc_coords, ldmatrix_a_coords, ldmatrix_b_coords
from .kv_cache import PAGE_SIZE
from .ptx import ldmatrix_x4, mma_bf16

DTYPE = "bfloat16"
FULL_MASK = 0xFFFFFFFF


def swizzled(row, chunk, chunks: int):
    """Element offset of 16-byte chunk `chunk` of `row` in a tile of rows of `chunks` chunks
    (a multiple of 8), the chunk XORed with row % 8."""
    return row * (chunks * 8) + (chunk ^ (row % 8)) * 8


def lane_xor(x, lane_mask: int):
    """x of the lane whose index differs by `lane_mask` (a quad's 4 lanes hold one row)."""
    return T.tvm_warp_shuffle_xor(FULL_MASK, x, lane_mask, 32, 32)


def tile_ops(kv_heads: int, d: int, tile_pages: int, nt: int):
    """(load_kv, attend_tile) macros for blocks of `nt` threads, head_dim `d` (a multiple of
    64) and tiles of `tile_pages` pages."""
    keys = tile_pages * PAGE_SIZE
    dch = d // 8  # 16-byte chunks of a head row
    d_tiles = d // 8  # n8 tiles of O a warp
    s_tiles = keys // 8  # n8 tiles of S a warp
    kv_copies = -(-keys * dch // nt)  # 16-byte copies a thread, for each of K and V
    pv_steps = keys // 16 * (d // 16)  # (k16 step, pair of n8 tiles) of O += P V
    scale = float(d) ** -0.5 * LOG2E

    @T.macro
    def s_fragments(q_sh, k_sh, a_frag, b_frag, kk, buf, k_base, warp, lane):
        # Q's A fragment and K's B fragments of k16 step kk, into fragment set `buf`
        ar, ac = T.meta_var(ldmatrix_a_coords(lane, kk))
        T.evaluate(ldmatrix_x4(a_frag, buf * 8, q_sh, swizzled(warp * 16 + ar, ac, dch)))
        for np in T.unroll(s_tiles // 2):
            br, bc = T.meta_var(ldmatrix_b_coords(lane, kk))
            T.evaluate(ldmatrix_x4(
                b_frag, (buf * (s_tiles // 2) + np) * 8, k_sh,
                k_base + swizzled(np * 16 + br, bc, dch),
            ))  # fmt: skip

    @T.macro
    def v_fragment(v_sh, b_frag, j, buf, k_base, lane):
        # V's B fragments (two n8 tiles) of step j, read transposed: lanes give key rows
        kk: T.let[T.int32] = j // (d // 16)
        np: T.let[T.int32] = j % (d // 16)
        T.evaluate(ldmatrix_x4(
            b_frag, buf * 8, v_sh,
            k_base + swizzled(kk * 16 + lane % 16, np * 2 + lane // 16, dch), trans=True,
        ))  # fmt: skip

    @T.macro
    def load_kv(kp, vp, k_sh, v_sh, stage, page0, last_page, tx, slot, table, kvh, layer64):
        # the tile of pages page0, page0 + 1, ... (none past last_page: clamped) into `stage`
        for it in T.unroll(kv_copies):
            x: T.let[T.int32] = T.min(it * nt + tx, keys * dch - 1)
            key: T.let[T.int32] = x // dch
            pg: T.let[T.int32] = T.min(page0 + key // PAGE_SIZE, last_page)
            page: T.let[T.int64] = T.Cast("int64", table[slot, pg])
            src: T.let[T.int64] = (
                ((layer64 * kp.shape[1] + page) * kv_heads + kvh) * PAGE_SIZE + key % PAGE_SIZE
            ) * d + x % dch * 8
            dst: T.let[T.int32] = stage * keys * d + swizzled(key, x % dch, dch)
            T.evaluate(T.s_tir.cp_async_raw.legacy(k_sh.data, dst, kp.data, src, 16, dtype=DTYPE))
            T.evaluate(T.s_tir.cp_async_raw.legacy(v_sh.data, dst, vp.data, src, 16, dtype=DTYPE))

    @T.macro
    def attend_tile(q_sh, k_sh, v_sh, stage, key0, row_pos, s_acc, p_frag, a_frag, b_frag,
                    o_acc, m_run, l_run, m_new, warp, lane):  # fmt: skip
        # The tile in `stage`, whose first key is key0 of the sequence, into this warp's
        # running (m_run, l_run, o_acc); key j is visible to row-half hr where j <= row_pos[hr]
        k_base: T.let[T.int32] = stage * keys * d
        for i in T.unroll(s_tiles * 4):
            s_acc[i] = T.float32(0)
        # the next k16 step's fragments load while this one's mma run
        s_fragments(q_sh, k_sh, a_frag, b_frag, 0, 0, k_base, warp, lane)
        for kk in T.unroll(d // 16):
            if kk + 1 < d // 16:
                s_fragments(q_sh, k_sh, a_frag, b_frag, kk + 1, (kk + 1) % 2, k_base, warp, lane)
            for np in T.unroll(s_tiles // 2):
                for h2 in T.unroll(2):
                    T.evaluate(mma_bf16(
                        a_frag.data, kk % 2 * 8,
                        b_frag.data, (kk % 2 * (s_tiles // 2) + np) * 8 + h2 * 4,
                        s_acc.data, (np * 2 + h2) * 4,
                    ))  # fmt: skip
        # the online softmax on the accumulators: lane holds rows lane // 4 (+ 8), columns
        # lane % 4 * 2 (+ 1) of each n8 tile
        for i in T.unroll(s_tiles * 4):
            er, ec = T.meta_var(acc_coords(lane, i % 4))
            s_acc[i] = T.Select(
                key0 + i // 4 * 8 + ec <= row_pos[i % 4 // 2],
                s_acc[i] * T.float32(scale),
                T.float32("-inf"),
            )
        for hr in T.unroll(2):
            m_new[hr] = m_run[hr]
        for i in T.unroll(s_tiles * 4):
            m_new[i % 4 // 2] = T.max(m_new[i % 4 // 2], s_acc[i])
        for hr in T.unroll(2):
            for sh_ in T.unroll(2):
                m_new[hr] = T.max(m_new[hr], lane_xor(m_new[hr], 1 << sh_))
            # a block's first tile holds a key visible to every row, so m_new is finite
            m_run[hr] = T.exp2(m_run[hr] - m_new[hr])  # now alpha
            l_run[hr] = l_run[hr] * m_run[hr]
        for i in T.unroll(d_tiles * 4):
            o_acc[i] = o_acc[i] * m_run[i % 4 // 2]
        for i in T.unroll(s_tiles * 4):
            s_acc[i] = T.exp2(s_acc[i] - m_new[i % 4 // 2])
            l_run[i % 4 // 2] = l_run[i % 4 // 2] + s_acc[i]
            p_frag[i] = T.Cast(DTYPE, s_acc[i])
        for hr in T.unroll(2):
            m_run[hr] = m_new[hr]
        # O += P V: P's accumulator order is mma's A fragment order
        v_fragment(v_sh, b_frag, 0, 0, k_base, lane)
        for j in T.unroll(pv_steps):
            if j + 1 < pv_steps:
                v_fragment(v_sh, b_frag, j + 1, (j + 1) % 2, k_base, lane)
            for h2 in T.unroll(2):
                T.evaluate(mma_bf16(
                    p_frag.data, j // (d // 16) * 8,
                    b_frag.data, j % 2 * 8 + h2 * 4,
                    o_acc.data, (j % (d // 16) * 2 + h2) * 4,
                ))  # fmt: skip

    return load_kv, attend_tile


def fragment_sizes(d: int, tile_pages: int) -> dict[str, int]:
    """Register fragments a lane holds for attend_tile: O's and S's accumulators, P, the A and
    B fragment pairs."""
    s_tiles = tile_pages * PAGE_SIZE // 8
    return {"o": d // 8 * 4, "s": s_tiles * 4, "a": 2 * 8, "b": 2 * max(1, s_tiles // 2) * 8}
