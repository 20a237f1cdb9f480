"""Tensor-core paged attention for bf16 prefill on sm_80+: the same contract as
`attention.paged_attention` (same parameters, the same result up to bf16 rounding of the
probabilities), for chunks of many tokens, where each K/V tile must serve many queries.

A block owns 16 consecutive query tokens of one sequence and one kv head: 16 x group rows
(every query head of the GQA group), one warp per 16 rows. Per tile of keys (`tile_pages`
pages, 2 by default):

1. the tile's K is copied to shared memory as stored ([key, dim]) and V transposed
   ([dim, key]), so both are the (n, k) operand mma.sync wants with k contiguous;
2. S = Q Kᵀ on tensor cores (Q sits in shared memory for the whole block), written to shared
   memory in fp32;
3. two threads per row run the online softmax (both keep the row's running max and sum, each
   writes half of P in bf16), masking keys past the row's position;
4. O = alpha O + P V on tensor cores, O accumulating in registers.

Shared tiles whose rows hold 8 or more 16-byte chunks XOR the chunk with row % 8 (ldmatrix
reads 8 rows at one chunk: 8 different banks); narrower ones use matmul.tile_offset. The
grid has a row of ceil(tokens / 16) query tiles for every sequence of a ragged batch; the
tiles past a sequence's end exit at once.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .kv_cache import PAGE_SIZE
from .matmul import acc_coords, ldmatrix_a_coords, ldmatrix_b_coords, tile_offset
from .ptx import ldmatrix_x4, mma_bf16

Q_TOKENS = 16  # query tokens a block
DTYPE = "bfloat16"


def _wide(row, chunk, chunks: int):
    """Element offset of 16-byte chunk `chunk` of `row` in a tile of rows of `chunks` chunks
    (a multiple of 8), the chunk XORed with row % 8."""
    return row * (chunks * 8) + (chunk ^ (row % 8)) * 8


def _at(row, chunk, chunks: int):
    """Offset of a 16-byte chunk in a shared tile of rows of `chunks` chunks."""
    return _wide(row, chunk, chunks) if chunks >= 8 else tile_offset(row, chunk, chunks)


@T.macro
def warp_mma(a_sh, a_chunks, b_sh, b_chunks, acc, ksteps, n_pairs, warp, lane, a_frag, b_frag):
    # acc (this warp's 16 rows x 16 n_pairs columns) += A[rows, :16 ksteps] B[cols, same]ᵀ,
    # both operands in shared memory with k contiguous
    for kk in T.unroll(ksteps):
        ar, ac = T.meta_var(ldmatrix_a_coords(lane, kk))
        T.evaluate(ldmatrix_x4(a_frag, 0, a_sh, _at(warp * 16 + ar, ac, a_chunks)))
        for np in T.unroll(n_pairs):
            br, bc = T.meta_var(ldmatrix_b_coords(lane, kk))
            T.evaluate(ldmatrix_x4(b_frag, 0, b_sh, _at(np * 16 + br, bc, b_chunks)))
            for h2 in T.unroll(2):
                T.evaluate(
                    mma_bf16(a_frag.data, 0, b_frag.data, h2 * 4, acc.data, (np * 2 + h2) * 4)
                )


def paged_prefill_mma(
    heads: int, kv_heads: int, head_dim: int, target: Target, tile_pages: int = 2
) -> PrimFunc:
    group, d = heads // kv_heads, head_dim
    keys = tile_pages * PAGE_SIZE  # keys a tile
    if heads % kv_heads or d % 64 or target.kind.name != "cuda":
        raise ValueError("tensor-core prefill: CUDA, head_dim a multiple of 64, GQA groups")
    rows = Q_TOKENS * group
    warps = rows // 16
    nt = warps * 32
    dch = d // 8  # 16-byte chunks of a head row
    kch = keys // 8  # 16-byte chunks of a key row of P or Vᵀ
    d_tiles = d // 8  # n8 tiles of O a warp
    s_tiles = keys // 8  # n8 tiles of S a warp
    scale = float(d) ** -0.5
    sh = "shared.dyn"

    @T.prim_func(s_tir=True)
    def attn_prefill_mma(
        q_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pos_h: T.handle,
        table_h: T.handle,
        kp_h: T.handle,
        vp_h: T.handle,
        layer: T.int32,
        o_h: T.handle,
        ws_acc_h: T.handle,
        ws_ml_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr, n_seq = T.int32(), T.int32(), T.int32()
        n_slots, width_pt, ws_rows = T.int32(), T.int32(), T.int32()
        n_layers, n_pages = T.int64(), T.int64()
        q = T.match_buffer(q_h, (n_tok, heads, d), DTYPE)
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        positions = T.match_buffer(pos_h, (n_tok,), "int32")
        table = T.match_buffer(table_h, (n_slots, width_pt), "int32")
        kp = T.match_buffer(kp_h, (n_layers, n_pages, kv_heads, PAGE_SIZE, d), DTYPE)
        vp = T.match_buffer(vp_h, (n_layers, n_pages, kv_heads, PAGE_SIZE, d), DTYPE)
        o = T.match_buffer(o_h, (n_tok, heads, d), DTYPE)
        T.match_buffer(ws_acc_h, (ws_rows, heads, d), "float32")  # unused: one piece
        T.match_buffer(ws_ml_h, (ws_rows, heads, 2), "float32")
        max_tiles: T.let[T.int32] = (n_tok + Q_TOKENS - 1) // Q_TOKENS
        for blk in T.thread_binding(n_seq * max_tiles * kv_heads, thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("prefill"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((rows * d,), DTYPE, scope=sh)
                    k_sh = T.sblock_alloc_buffer((keys * d,), DTYPE, scope=sh)
                    vt_sh = T.sblock_alloc_buffer((d * keys,), DTYPE, scope=sh)
                    # static shared memory: TVM plans barriers for all dynamic shared memory as
                    # one buffer, which would put one inside the softmax phase
                    s_sh = T.sblock_alloc_buffer((rows * keys,), "float32", scope="shared")
                    p_sh = T.sblock_alloc_buffer((rows * keys,), DTYPE, scope="shared")
                    alpha = T.sblock_alloc_buffer((nt,), "float32", scope="shared")
                    o_acc = T.sblock_alloc_buffer((d_tiles * 4,), "float32", scope="local")
                    s_acc = T.sblock_alloc_buffer((s_tiles * 4,), "float32", scope="local")
                    a_frag = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    b_frag = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    reg = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    ml = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    mx = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    kvh: T.let[T.int32] = blk % kv_heads
                    tile: T.let[T.int32] = blk // kv_heads
                    warp: T.let[T.int32] = tx // 32
                    lane: T.let[T.int32] = tx % 32
                    # blocks past their sequence's last tile run no key tile and store nothing
                    seq: T.let[T.int32] = tile // max_tiles
                    found: T.let[T.bool] = (
                        indptr[seq] + tile % max_tiles * Q_TOKENS < indptr[seq + 1]
                    )
                    t0: T.let[T.int32] = T.Select(
                        found, indptr[seq] + tile % max_tiles * Q_TOKENS, indptr[seq]
                    )
                    n_q: T.let[T.int32] = T.min(Q_TOKENS, indptr[seq + 1] - t0)
                    slot: T.let[T.int32] = slots[seq]
                    last_pos: T.let[T.int32] = positions[t0 + n_q - 1]
                    seq_pages: T.let[T.int32] = last_pos // PAGE_SIZE + 1
                    layer64: T.let[T.int64] = T.Cast("int64", layer)
                    # the block's queries; rows past the chunk repeat its last token
                    for e in T.serial((rows * dch + nt - 1) // nt):
                        x: T.let[T.int32] = e * nt + tx
                        r: T.let[T.int32] = T.min(x // dch, rows - 1)
                        tok: T.let[T.int32] = t0 + T.min(r // group, n_q - 1)
                        if x < rows * dch:
                            for i in T.vectorized(8):
                                reg[i] = q[tok, kvh * group + r % group, x % dch * 8 + i]
                            for i in T.vectorized(8):
                                q_sh[_wide(r, x % dch, dch) + i] = reg[i]
                    for i in T.unroll(d_tiles * 4):  # unrolled: registers, not local memory
                        o_acc[i] = T.float32(0)
                    ml[0] = T.float32("-inf")
                    ml[1] = T.float32(0)
                    for kt in T.serial(T.Select(found, (last_pos + keys) // keys, 0)):
                        T.tvm_storage_sync("shared.dyn")
                        # 1. K as stored, V transposed
                        for e in T.serial((keys * dch + nt - 1) // nt):
                            x: T.let[T.int32] = T.min(e * nt + tx, keys * dch - 1)
                            key: T.let[T.int32] = x // dch
                            pg: T.let[T.int32] = T.min(kt * keys // PAGE_SIZE + key // PAGE_SIZE,
                                                       seq_pages - 1)  # fmt: skip
                            page: T.let[T.int64] = T.Cast("int64", table[slot, pg])
                            c: T.let[T.int32] = x % dch
                            for i in T.vectorized(8):
                                reg[i] = kp[layer64, page, kvh, key % PAGE_SIZE, c * 8 + i]
                            for i in T.vectorized(8):
                                k_sh[_wide(key, c, dch) + i] = reg[i]
                        # V with a warp's lanes along keys: its transposed stores then fill
                        # consecutive addresses of one row
                        for e in T.serial((keys * dch + nt - 1) // nt):
                            x: T.let[T.int32] = T.min(e * nt + tx, keys * dch - 1)
                            key: T.let[T.int32] = x % keys
                            pg: T.let[T.int32] = T.min(kt * keys // PAGE_SIZE + key // PAGE_SIZE,
                                                       seq_pages - 1)  # fmt: skip
                            page: T.let[T.int64] = T.Cast("int64", table[slot, pg])
                            c: T.let[T.int32] = x // keys
                            for i in T.vectorized(8):
                                reg[i] = vp[layer64, page, kvh, key % PAGE_SIZE, c * 8 + i]
                            for i in T.unroll(8):
                                vt_sh[tile_offset(c * 8 + i, key // 8, kch) + key % 8] = reg[i]
                        T.tvm_storage_sync("shared.dyn")
                        # 2. S = Q Kᵀ for this warp's 16 rows
                        for i in T.unroll(s_tiles * 4):
                            s_acc[i] = T.float32(0)
                        warp_mma(q_sh, dch, k_sh, dch, s_acc, d // 16, s_tiles // 2, warp, lane,
                                 a_frag, b_frag)  # fmt: skip
                        for nt8 in T.unroll(s_tiles):
                            for e in T.unroll(4):
                                er, ec = T.meta_var(acc_coords(lane, e))
                                s_sh[(warp * 16 + er) * keys + nt8 * 8 + ec] = s_acc[nt8 * 4 + e]
                        T.tvm_storage_sync("shared.dyn")
                        # 3. the online softmax: two threads a row, each writing half of P; both
                        # keep the row's running max and sum, so no thread waits on another
                        row_pos: T.let[T.int32] = positions[
                            t0 + T.min(tx // 2 // group, n_q - 1)
                        ]
                        mx[0] = ml[0]
                        for j in T.serial(keys):
                            mx[0] = T.max(mx[0], T.Select(
                                kt * keys + j <= row_pos,
                                s_sh[tx // 2 * keys + j] * T.float32(scale),
                                T.float32("-inf"),
                            ))  # fmt: skip
                        mx[1] = T.float32(0)
                        for j in T.serial(keys):
                            mx[1] = mx[1] + T.Select(
                                kt * keys + j <= row_pos,
                                T.exp(s_sh[tx // 2 * keys + j] * T.float32(scale) - mx[0]),
                                T.float32(0),
                            )
                        for jh in T.serial(keys // 2):
                            p_sh[
                                tile_offset(tx // 2, (tx % 2 * (keys // 2) + jh) // 8, kch)
                                + jh % 8
                            ] = T.Cast(DTYPE, T.Select(
                                kt * keys + tx % 2 * (keys // 2) + jh <= row_pos,
                                T.exp(
                                    s_sh[tx // 2 * keys + tx % 2 * (keys // 2) + jh]
                                    * T.float32(scale) - mx[0]
                                ),
                                T.float32(0),
                            ))  # fmt: skip
                        alpha[tx] = T.exp(ml[0] - mx[0])
                        ml[1] = ml[1] * T.exp(ml[0] - mx[0]) + mx[1]
                        ml[0] = mx[0]
                        T.tvm_storage_sync("shared")
                        # 4. O = alpha O + P V
                        for nt8 in T.unroll(d_tiles):
                            for e in T.unroll(4):
                                er, ec = T.meta_var(acc_coords(lane, e))
                                a_r: T.let[T.int32] = (warp * 16 + er) * 2  # a row's first thread
                                o_acc[nt8 * 4 + e] = o_acc[nt8 * 4 + e] * alpha[a_r]
                        warp_mma(p_sh, kch, vt_sh, kch, o_acc, keys // 16, d_tiles // 2, warp,
                                 lane, a_frag, b_frag)  # fmt: skip
                    T.tvm_storage_sync("shared.dyn")
                    alpha[tx] = ml[1]
                    T.tvm_storage_sync("shared.dyn")
                    for nt8 in T.unroll(d_tiles):
                        for e in T.unroll(4):
                            er, ec = T.meta_var(acc_coords(lane, e))
                            r: T.let[T.int32] = warp * 16 + er
                            if found and r // group < n_q:
                                o[t0 + r // group, kvh * group + r % group, nt8 * 8 + ec] = (
                                    T.Cast(DTYPE, o_acc[nt8 * 4 + e] / alpha[r * 2])
                                )

    return attn_prefill_mma
