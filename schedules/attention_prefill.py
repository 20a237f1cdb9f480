"""Tensor-core paged attention for bf16 prefill on sm_80+: the contract of
`attention.paged_attention` (the same parameters, output gate included, and the same result up
to bf16 rounding of the probabilities), for chunks of many tokens, where each K/V tile must
serve many queries.

A block owns `q_tokens` consecutive query tokens of one sequence and one kv head: q_tokens x
group rows (every query head of the GQA group), one warp per 16 rows. Per tile of keys
(`tile_pages` pages):

1. the next tile's K and V are already in flight (cp.async into the other of two stages),
   copied as stored ([key, dim]): K is mma's (n, k) operand as is, V is read transposed by
   `ldmatrix.trans`;
2. S = Q Kᵀ on tensor cores into registers (Q sits in shared memory for the whole block);
3. the online softmax runs on those registers: a row's 16-key slices live in the 4 lanes of
   a quad, so its max is two shuffles away, and the row sums stay per lane until the end;
4. P, rounded to bf16 in place, is already laid out as mma's A fragment, so
   O = alpha O + P V follows on tensor cores without touching shared memory.

At the end o, rounded, is staged in Q's shared rows, so that the output gate's loads (from
qkv_proj's row) and o's stores are whole 16-byte chunks; an mma accumulator's lanes hold 4
bytes of each of 8 rows.

One barrier a tile. Shared rows XOR their 16-byte chunk with row % 8 (ldmatrix reads 8 rows
at one chunk: 8 different banks). The query tiles of a ragged batch are numbered
sequence after sequence, at most one unused number a sequence (those blocks exit at once); the
last tiles (the longest under the causal mask) run first.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .attention import LOG2E
from .attention_prep import gate_column, gate_product
from .kv_cache import PAGE_SIZE, first_tile
from .matmul import acc_coords, ldmatrix_a_coords, ldmatrix_b_coords
from .pdl import release_dependents, wait_for_producers
from .ptx import ldmatrix_x4, mma_bf16

DTYPE = "bfloat16"
STAGES = 2  # K/V tiles in shared memory: the one computed on and the one arriving
FULL_MASK = 0xFFFFFFFF


def _at(row, chunk, chunks: int):
    """Element offset of 16-byte chunk `chunk` of `row` in a tile of rows of `chunks` chunks
    (a multiple of 8), the chunk XORed with row % 8."""
    return row * (chunks * 8) + (chunk ^ (row % 8)) * 8


def _lane_xor(x, lane_mask: int):
    """x of the lane whose index differs by `lane_mask` (a quad's 4 lanes hold one row)."""
    return T.tvm_warp_shuffle_xor(FULL_MASK, x, lane_mask, 32, 32)


def paged_prefill_mma(
    heads: int,
    kv_heads: int,
    head_dim: int,
    target: Target,
    tile_pages: int = 2,
    q_tokens: int = 16,
) -> PrimFunc:
    group, d = heads // kv_heads, head_dim
    keys = tile_pages * PAGE_SIZE  # keys a tile
    if heads % kv_heads or d % 64 or target.kind.name != "cuda":
        raise ValueError("tensor-core prefill: CUDA, head_dim a multiple of 64, GQA groups")
    rows = q_tokens * group
    if rows % 16:
        raise ValueError(f"q_tokens {q_tokens} x group {group} must fill whole warps of 16 rows")
    nt = rows // 16 * 32
    dch = d // 8  # 16-byte chunks of a head row
    d_tiles = d // 8  # n8 tiles of O a warp
    s_tiles = keys // 8  # n8 tiles of S a warp
    kv_copies = -(-keys * dch // nt)  # 16-byte copies a thread, for each of K and V
    q_copies = -(-rows * dch // nt)
    out_chunks = rows * dch // nt  # 16-byte chunks of o a thread stores (exact: dch % 8 == 0)
    scale = float(d) ** -0.5 * LOG2E  # the softmax runs on exp2
    sh = "shared.dyn"

    pv_steps = keys // 16 * (d // 16)  # (k16 step, pair of n8 tiles) of O += P V

    @T.macro
    def s_fragments(q_sh, k_sh, a_frag, b_frag, kk, buf, k_base, warp, lane):
        # Q's A fragment and K's B fragments of k16 step kk, into fragment set `buf`
        ar, ac = T.meta_var(ldmatrix_a_coords(lane, kk))
        T.evaluate(ldmatrix_x4(a_frag, buf * 8, q_sh, _at(warp * 16 + ar, ac, dch)))
        for np in T.unroll(s_tiles // 2):
            br, bc = T.meta_var(ldmatrix_b_coords(lane, kk))
            T.evaluate(ldmatrix_x4(
                b_frag, (buf * (s_tiles // 2) + np) * 8, k_sh, k_base + _at(np * 16 + br, bc, dch)
            ))  # fmt: skip

    @T.macro
    def v_fragment(v_sh, b_frag, j, buf, k_base, lane):
        # V's B fragments (two n8 tiles) of step j, read transposed: lanes give key rows
        kk: T.let[T.int32] = j // (d // 16)
        np: T.let[T.int32] = j % (d // 16)
        T.evaluate(ldmatrix_x4(
            b_frag, buf * 8, v_sh,
            k_base + _at(kk * 16 + lane % 16, np * 2 + lane // 16, dch), trans=True,
        ))  # fmt: skip

    @T.macro
    def tile_of(indptr, n_seq, g, info, cnt_sh, tx, warp, lane):
        # info[0] <- the last sequence whose first tile is <= g: every thread counts its share
        # of the sequences, so the search costs one round of loads, not a chain of them
        info[0] = 0
        for i in T.serial((n_seq + nt - 1) // nt):
            if i * nt + tx < n_seq:
                if first_tile(indptr, i * nt + tx, q_tokens) <= g:
                    info[0] = info[0] + 1
        for sh_ in T.unroll(5):
            info[0] = info[0] + _lane_xor(info[0], 1 << sh_)
        if lane == 0:
            cnt_sh[warp] = info[0]
        T.tvm_storage_sync("shared.dyn")
        info[0] = -1
        for w in T.unroll(nt // 32):
            info[0] = info[0] + cnt_sh[w]

    @T.macro
    def load_kv(kp, vp, k_sh, v_sh, stage, kt, tx, slot, table, seq_pages, kvh, layer64):
        for it in T.unroll(kv_copies):
            x: T.let[T.int32] = T.min(it * nt + tx, keys * dch - 1)
            key: T.let[T.int32] = x // dch
            pg: T.let[T.int32] = T.min(kt * tile_pages + key // PAGE_SIZE, seq_pages - 1)
            page: T.let[T.int64] = T.Cast("int64", table[slot, pg])
            src: T.let[T.int64] = (
                ((layer64 * kp.shape[1] + page) * kv_heads + kvh) * PAGE_SIZE + key % PAGE_SIZE
            ) * d + x % dch * 8
            dst: T.let[T.int32] = stage * keys * d + _at(key, x % dch, dch)
            T.evaluate(T.s_tir.cp_async_raw.legacy(k_sh.data, dst, kp.data, src, 16, dtype=DTYPE))
            T.evaluate(T.s_tir.cp_async_raw.legacy(v_sh.data, dst, vp.data, src, 16, dtype=DTYPE))

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
        gate_h: T.handle,
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
        # qkv_proj's rows, whose width is static so that a gate chunk is one 16-byte load
        gate = T.match_buffer(gate_h, (n_tok, (2 * heads + 2 * kv_heads) * d), DTYPE)
        o = T.match_buffer(o_h, (n_tok, heads, d), DTYPE)
        T.match_buffer(ws_acc_h, (ws_rows, heads, d), "float32")  # unused: one piece
        T.match_buffer(ws_ml_h, (ws_rows, heads, 2), "float32")
        # sequence s's query tiles are numbered from first_tile(s) on; its gap to the next
        # sequence's is at least its tile count, so at most n_seq numbers go unused
        n_tiles_all: T.let[T.int32] = n_tok // q_tokens + n_seq
        for blk in T.thread_binding(n_tiles_all * kv_heads, thread="blockIdx.x"):
            for tx in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("prefill"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((rows * d,), DTYPE, scope=sh)
                    k_sh = T.sblock_alloc_buffer((STAGES * keys * d,), DTYPE, scope=sh)
                    v_sh = T.sblock_alloc_buffer((STAGES * keys * d,), DTYPE, scope=sh)
                    o_acc = T.sblock_alloc_buffer((d_tiles * 4,), "float32", scope="local")
                    s_acc = T.sblock_alloc_buffer((s_tiles * 4,), "float32", scope="local")
                    p_frag = T.sblock_alloc_buffer((s_tiles * 4,), DTYPE, scope="local")
                    a_frag = T.sblock_alloc_buffer((2 * 8,), DTYPE, scope="local")
                    b_frag = T.sblock_alloc_buffer((2 * max(1, s_tiles // 2) * 8,), DTYPE,
                                                   scope="local")  # fmt: skip
                    row_pos = T.sblock_alloc_buffer((2,), "int32", scope="local")
                    info = T.sblock_alloc_buffer((5,), "int32", scope="local")
                    m_run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    l_run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    m_new = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    o_vec = T.sblock_alloc_buffer((8,), DTYPE, scope="local")
                    g_all = T.sblock_alloc_buffer((out_chunks * 8,), DTYPE, scope="local")
                    cnt_sh = T.sblock_alloc_buffer((nt // 32,), "int32", scope=sh)
                    T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                    T.evaluate(release_dependents(True))
                    kvh: T.let[T.int32] = blk % kv_heads
                    warp: T.let[T.int32] = tx // 32
                    lane: T.let[T.int32] = tx % 32
                    # the last query tiles see the most keys: run them first
                    g: T.let[T.int32] = n_tiles_all - 1 - blk // kv_heads
                    # what depends on the search is stored, never let-bound: TVM's shared
                    # memory planner refuses a local buffer read by a let at the kernel's top
                    tile_of(indptr, n_seq, g, info, cnt_sh, tx, warp, lane)
                    seq = T.meta_var(info[0])
                    info[1] = indptr[seq] + (g - first_tile(indptr, seq, q_tokens)) * q_tokens
                    info[2] = T.Select(info[1] < indptr[seq + 1], 1, 0)
                    info[1] = T.Select(info[2] > 0, info[1], indptr[seq])
                    info[3] = T.min(q_tokens, indptr[seq + 1] - info[1])
                    info[4] = positions[info[1] + info[3] - 1]  # the last query's position
                    t0 = T.meta_var(info[1])
                    found = T.meta_var(info[2] > 0)
                    n_q = T.meta_var(info[3])
                    slot = T.meta_var(slots[seq])
                    seq_pages = T.meta_var(info[4] // PAGE_SIZE + 1)
                    n_tiles = T.meta_var(T.Select(found, (info[4] + keys) // keys, 0))
                    layer64: T.let[T.int64] = T.Cast("int64", layer)
                    # the block's queries (rows past the chunk repeat its last token), in the
                    # same copy group as the first K/V tile
                    for it in T.unroll(q_copies):
                        x: T.let[T.int32] = T.min(it * nt + tx, rows * dch - 1)
                        r: T.let[T.int32] = x // dch
                        tok = T.meta_var(t0 + T.min(r // group, n_q - 1))
                        T.evaluate(
                            T.s_tir.cp_async_raw.legacy(
                                q_sh.data,
                                _at(r, x % dch, dch),
                                q.data,
                                (tok * heads + kvh * group + r % group) * d + x % dch * 8,
                                16,
                                dtype=DTYPE,
                            )
                        )
                    if n_tiles > 0:
                        load_kv(kp, vp, k_sh, v_sh, 0, 0, tx, slot, table, seq_pages, kvh, layer64)
                    T.evaluate(T.ptx["cp.async.commit_group"]())
                    for hr in T.unroll(2):
                        row_pos[hr] = positions[
                            t0 + T.min((warp * 16 + lane // 4 + hr * 8) // group, n_q - 1)
                        ]
                        m_run[hr] = T.float32("-inf")
                        l_run[hr] = T.float32(0)
                    for i in T.unroll(d_tiles * 4):  # unrolled: registers, not local memory
                        o_acc[i] = T.float32(0)
                    for kt in T.serial(n_tiles):
                        # tile kt has landed; the barrier also retires the stage refilled next
                        T.evaluate(T.ptx["cp.async.wait_group"](0))
                        T.tvm_storage_sync("shared.dyn")
                        if kt + 1 < n_tiles:
                            load_kv(kp, vp, k_sh, v_sh, (kt + 1) % STAGES, kt + 1, tx, slot,
                                    table, seq_pages, kvh, layer64)  # fmt: skip
                        T.evaluate(T.ptx["cp.async.commit_group"]())
                        k_base: T.let[T.int32] = kt % STAGES * keys * d
                        # 2. S = Q Kᵀ for this warp's 16 rows
                        for i in T.unroll(s_tiles * 4):
                            s_acc[i] = T.float32(0)
                        # the next k16 step's fragments load while this one's mma run
                        s_fragments(q_sh, k_sh, a_frag, b_frag, 0, 0, k_base, warp, lane)
                        for kk in T.unroll(d // 16):
                            if kk + 1 < d // 16:
                                s_fragments(q_sh, k_sh, a_frag, b_frag, kk + 1, (kk + 1) % 2,
                                            k_base, warp, lane)  # fmt: skip
                            for np in T.unroll(s_tiles // 2):
                                for h2 in T.unroll(2):
                                    T.evaluate(mma_bf16(
                                        a_frag.data, kk % 2 * 8,
                                        b_frag.data, (kk % 2 * (s_tiles // 2) + np) * 8 + h2 * 4,
                                        s_acc.data, (np * 2 + h2) * 4,
                                    ))  # fmt: skip
                        # 3. the online softmax on the accumulators: lane holds rows
                        # lane // 4 (+ 8), columns lane % 4 * 2 (+ 1) of each n8 tile
                        for i in T.unroll(s_tiles * 4):
                            er, ec = T.meta_var(acc_coords(lane, i % 4))
                            s_acc[i] = T.Select(
                                kt * keys + i // 4 * 8 + ec <= row_pos[i % 4 // 2],
                                s_acc[i] * T.float32(scale),
                                T.float32("-inf"),
                            )
                        for hr in T.unroll(2):
                            m_new[hr] = m_run[hr]
                        for i in T.unroll(s_tiles * 4):
                            m_new[i % 4 // 2] = T.max(m_new[i % 4 // 2], s_acc[i])
                        for hr in T.unroll(2):
                            for sh_ in T.unroll(2):
                                m_new[hr] = T.max(m_new[hr], _lane_xor(m_new[hr], 1 << sh_))
                            # key 0 is visible to every row, so m_new is finite from tile 0 on
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
                        # 4. O += P V: P's accumulator order is mma's A fragment order
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
                    for hr in T.unroll(2):
                        for sh_ in T.unroll(2):
                            l_run[hr] = l_run[hr] + _lane_xor(l_run[hr], 1 << sh_)
                    # 5. o, rounded, goes through this warp's rows of q_sh (Q's copies have
                    # all landed: with no tile, they are waited for here) so that the gate's
                    # loads and o's stores move whole 16-byte chunks
                    T.evaluate(T.ptx["cp.async.wait_group"](0))
                    T.tvm_storage_sync("shared.dyn")
                    for nt8 in T.unroll(d_tiles):
                        for e in T.unroll(4):
                            er, ec = T.meta_var(acc_coords(lane, e))
                            q_sh[_at(warp * 16 + er, nt8, dch) + ec] = T.Cast(
                                DTYPE, o_acc[nt8 * 4 + e] / l_run[e // 2]
                            )
                    T.tvm_storage_sync("shared.dyn")
                    # every gate chunk is loaded before any store: under the store's condition
                    # the loads went one round trip after another (SASS); rows past the chunk
                    # re-read its last token, in bounds
                    for it in T.unroll(out_chunks):
                        x: T.let[T.int32] = it * nt + tx
                        r: T.let[T.int32] = x // dch
                        hd: T.let[T.int32] = kvh * group + r % group
                        tok = T.meta_var(T.max(t0 + T.min(r // group, n_q - 1), 0))
                        for v in T.vectorized(8):
                            g_all[it * 8 + v] = gate[tok, gate_column(hd, d) + x % dch * 8 + v]
                    for it in T.unroll(out_chunks):
                        x: T.let[T.int32] = it * nt + tx
                        r: T.let[T.int32] = x // dch
                        c: T.let[T.int32] = x % dch * 8
                        hd: T.let[T.int32] = kvh * group + r % group
                        if found and r // group < n_q:
                            for v in T.vectorized(8):
                                o_vec[v] = q_sh[_at(r, x % dch, dch) + v]
                            for v in T.unroll(8):
                                o_vec[v] = gate_product(
                                    T.Cast("float32", o_vec[v]),
                                    T.Cast("float32", g_all[it * 8 + v]),
                                    DTYPE,
                                )
                            for v in T.vectorized(8):
                                o[t0 + r // group, hd, c + v] = o_vec[v]

    return attn_prefill_mma
