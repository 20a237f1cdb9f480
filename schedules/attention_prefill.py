"""Tensor-core paged attention for bf16 prefill on sm_80+: the contract of
`attention.paged_attention` (the same parameters, output gate included, and the same result up
to bf16 rounding of the probabilities), for chunks of many tokens, where each K/V tile must
serve many queries.

A block owns `q_tokens` consecutive query tokens of one sequence and one kv head: q_tokens x
group rows (every query head of the GQA group), one warp per 16 rows. Per tile of keys
(`tile_pages` pages) the next tile's K and V are already in flight (cp.async into the other of
two stages) while the warps run attention_mma's tile step on this one.

At the end o, rounded, is staged in Q's shared rows, so that the output gate's loads (from
qkv_proj's row) and o's stores are whole 16-byte chunks; an mma accumulator's lanes hold 4
bytes of each of 8 rows.

One barrier a tile. The query tiles of a ragged batch are numbered
sequence after sequence, at most one unused number a sequence (those blocks exit at once); the
last tiles (the longest under the causal mask) run first.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .attention_mma import DTYPE, fragment_sizes, lane_xor, swizzled, tile_ops
from .attention_prep import gate_column, gate_product
from .gemm_layout import acc_coords
from .kv_cache import PAGE_SIZE, first_tile
from .pdl import release_dependents, wait_for_producers

STAGES = 2  # K/V tiles in shared memory: the one computed on and the one arriving


def paged_prefill_mma(
    heads: int,
    kv_heads: int,
    head_dim: int,
    target: Target,
    tile_pages: int = 2,
    q_tokens: int = 16,
    skip_single: bool = False,
) -> PrimFunc:
    """`skip_single`: one-token sequences (a mixed step's decode rows) are left to
    attention_decode_mma's ragged kernel: their blocks store nothing (named apart, as a module
    holds both forms)."""
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
    q_copies = -(-rows * dch // nt)
    out_chunks = rows * dch // nt  # 16-byte chunks of o a thread stores (exact: dch % 8 == 0)
    sh = "shared.dyn"
    frag = fragment_sizes(d, tile_pages)
    load_kv, attend_tile = tile_ops(kv_heads, d, tile_pages, nt)

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
            info[0] = info[0] + lane_xor(info[0], 1 << sh_)
        if lane == 0:
            cnt_sh[warp] = info[0]
        T.tvm_storage_sync("shared.dyn")
        info[0] = -1
        for w in T.unroll(nt // 32):
            info[0] = info[0] + cnt_sh[w]

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
                    o_acc = T.sblock_alloc_buffer((frag["o"],), "float32", scope="local")
                    s_acc = T.sblock_alloc_buffer((frag["s"],), "float32", scope="local")
                    p_frag = T.sblock_alloc_buffer((frag["s"],), DTYPE, scope="local")
                    a_frag = T.sblock_alloc_buffer((frag["a"],), DTYPE, scope="local")
                    b_frag = T.sblock_alloc_buffer((frag["b"],), DTYPE, scope="local")
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
                    if skip_single:
                        if indptr[seq + 1] - indptr[seq] == 1:
                            info[2] = 0
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
                                swizzled(r, x % dch, dch),
                                q.data,
                                (tok * heads + kvh * group + r % group) * d + x % dch * 8,
                                16,
                                dtype=DTYPE,
                            )
                        )
                    if n_tiles > 0:
                        load_kv(kp, vp, k_sh, v_sh, 0, 0, seq_pages - 1, tx, slot, table, kvh,
                                layer64)  # fmt: skip
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
                            load_kv(kp, vp, k_sh, v_sh, (kt + 1) % STAGES, (kt + 1) * tile_pages,
                                    seq_pages - 1, tx, slot, table, kvh, layer64)  # fmt: skip
                        T.evaluate(T.ptx["cp.async.commit_group"]())
                        attend_tile(q_sh, k_sh, v_sh, kt % STAGES, kt * keys, row_pos, s_acc,
                                    p_frag, a_frag, b_frag, o_acc, m_run, l_run, m_new, warp,
                                    lane)  # fmt: skip
                    for hr in T.unroll(2):
                        for sh_ in T.unroll(2):
                            l_run[hr] = l_run[hr] + lane_xor(l_run[hr], 1 << sh_)
                    # o, rounded, goes through this warp's rows of q_sh (Q's copies have
                    # all landed: with no tile, they are waited for here) so that the gate's
                    # loads and o's stores move whole 16-byte chunks
                    T.evaluate(T.ptx["cp.async.wait_group"](0))
                    T.tvm_storage_sync("shared.dyn")
                    for nt8 in T.unroll(d_tiles):
                        for e in T.unroll(4):
                            er, ec = T.meta_var(acc_coords(lane, e))
                            q_sh[swizzled(warp * 16 + er, nt8, dch) + ec] = T.Cast(
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
                                o_vec[v] = q_sh[swizzled(r, x % dch, dch) + v]
                            for v in T.unroll(8):
                                o_vec[v] = gate_product(
                                    T.Cast("float32", o_vec[v]),
                                    T.Cast("float32", g_all[it * 8 + v]),
                                    DTYPE,
                                )
                            for v in T.vectorized(8):
                                o[t0 + r // group, hd, c + v] = o_vec[v]

    if skip_single:
        return attn_prefill_mma.with_attr("global_symbol", "attn_prefill_mma_mixed")
    return attn_prefill_mma
