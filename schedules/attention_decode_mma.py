"""Tensor-core split-KV paged attention for bf16 decode on sm_80+: the contract of
`attention.paged_attention` (the same parameters, output gate and split pieces, merged by the
same second kernel), for steps of a few tokens each far into its sequence.

A block owns one split piece of one token's keys for one kv head: one warp, whose 16 mma rows
are the GQA group's query heads (repeated to fill 16; only the group's rows are stored). Its
tiles stream through a ring of `stages` cp.async stages while the warp runs attention_mma's tile
step on the oldest, so a block keeps `stages - 1` tiles in flight and its tile's arithmetic (a
few hundred mma, against ~2 µs of SIMT work a tile in paged_attention) hides behind them.
Pieces are cut as paged_attention cuts them (`split_pages`), so the merge is its merge.

Before its wait for the producer (schedules/pdl.py) a block finds its sequence, slot and pages
from the step's inputs and, where its first tile holds none of the keys this step appends,
copies that tile already: the producer writes only this step's positions.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .attention import SPLIT_BUDGET, num_splits, output_gate
from .attention_merge import key_pages, merge_phase, split_pages
from .attention_mma import DTYPE, fragment_sizes, lane_xor, swizzled, tile_ops
from .gemm_layout import acc_coords
from .kv_cache import PAGE_SIZE, seq_of_token
from .pdl import release_dependents, wait_at_end, wait_for_producers

ROWS = 16  # mma's m16: one warp's query rows
# Tiles of 2 pages, 2 stages (3 blocks an SM), 96 pieces at most a step: in a graph B1 L32k
# 37.8 µs, B16 L4k 69.6, B64 L1k 72.1 against the SIMT kernel's 41.0, 72.3 and 75.8
# (attention_kernel_s24a.json; 1-page tiles, 2 stages, 128 pieces: 37.6, 67.9, 75.4)
TILE_PAGES, STAGES, DECODE_SPLIT_BUDGET = 2, 2, 96
MERGE_THREADS = 128
# A mixed step's decode rows (one-token sequences of its prefill) through this kernel's ragged
# form, beside the prefill kernel, instead of a prefill block each walking its whole context
# (compile/layers.py). With gdn_chunked.MIXED_ROWS_BESIDE_SCAN, 16 rows + 112 prompt tokens:
# 7.07 -> 6.37 ms a mixed step on the H200 (mixed_step_ovl2_s26.json), the check holding.
MIXED_ROWS_SPLIT = True
SHARED_PER_SM = 227 * 1024  # sm_90; sm_80 has 163 KB (fewer blocks an SM, same code)


def blocks_per_sm(head_dim: int, tile_pages: int, stages: int) -> int:
    """Blocks an sm_90 SM holds by shared memory (Q's 16 rows and the K/V ring), each with
    1 KB reserved."""
    ring = 2 * stages * tile_pages * PAGE_SIZE * head_dim * 2
    return SHARED_PER_SM // (ROWS * head_dim * 2 + ring + 1024)


def paged_decode_mma(
    heads: int,
    kv_heads: int,
    head_dim: int,
    target: Target,
    tile_pages: int = TILE_PAGES,
    stages: int = STAGES,
    split_budget: int = DECODE_SPLIT_BUDGET,
    ragged: bool = False,
) -> PrimFunc:
    """paged_attention's function with the split kernel on tensor cores: (q, indptr, slots,
    positions, page_table, k_pool, v_pool, layer, qkv_proj's output) -> (o, the pieces'
    workspaces of SPLIT_BUDGET rows). Each token's keys are cut into num_splits(n_tok,
    split_budget) pieces (at most SPLIT_BUDGET).

    `ragged`: the same over a prefill's one-token sequences only (a mixed step's decode rows),
    whose other rows paged_prefill_mma(skip_single=True) writes: a block's unit is a sequence
    (its keys cut into num_splits(sequences) pieces), and the blocks and merge columns of longer
    sequences do nothing. o and the workspaces are the prefill kernel's outputs, updated in
    place (compile/layers.py). It runs beside that kernel: everything it reads was written two
    or more kernels back (the attention input kernel's q, K and V; qkv_proj's gates) and what
    it writes the prefill kernel leaves alone, so its split kernel does not wait before it
    starts; thread 0 of block 0 waits at its end, so the merge, and what follows, see both."""
    group, d = heads // kv_heads, head_dim
    if heads % kv_heads or d % 64 or target.kind.name != "cuda" or group > ROWS:
        raise ValueError("tensor-core decode: CUDA, head_dim a multiple of 64, <= 16 heads a group")
    if not 2 <= stages <= 8 or split_budget > SPLIT_BUDGET:
        raise ValueError(f"stages 2-8 and a split budget <= {SPLIT_BUDGET}")
    keys, tp, nt = tile_pages * PAGE_SIZE, tile_pages, 32
    dch = d // 8
    q_copies = ROWS * dch // nt
    frag = fragment_sizes(d, tile_pages)
    load_kv, attend_tile = tile_ops(kv_heads, d, tile_pages, nt)
    sh = "shared.dyn"
    ws_rows = SPLIT_BUDGET

    gate_value, finish = output_gate(d, DTYPE)

    merge = merge_phase(heads, d, MERGE_THREADS, tp, ws_rows, True, gate_value, finish)

    def units(n_tok, n_seq):
        return n_seq if ragged else n_tok  # a workspace row's owners

    def token_of(indptr, u):
        return indptr[u] if ragged else u

    @T.prim_func(s_tir=True)
    def attn_decode_mma(
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
        n_slots, width_pt, g_width = T.int32(), T.int32(), T.int32()
        n_layers, n_pages = T.int64(), T.int64()
        q = T.match_buffer(q_h, (n_tok, heads, d), DTYPE)
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        positions = T.match_buffer(pos_h, (n_tok,), "int32")
        table = T.match_buffer(table_h, (n_slots, width_pt), "int32")
        kp = T.match_buffer(kp_h, (n_layers, n_pages, kv_heads, PAGE_SIZE, d), DTYPE)
        vp = T.match_buffer(vp_h, (n_layers, n_pages, kv_heads, PAGE_SIZE, d), DTYPE)
        gate = T.match_buffer(gate_h, (n_tok, g_width), DTYPE)
        o = T.match_buffer(o_h, (n_tok, heads, d), DTYPE)
        ws_acc = T.match_buffer(ws_acc_h, (ws_rows, heads, d), "float32")
        ws_ml = T.match_buffer(ws_ml_h, (ws_rows, heads, 2), "float32")
        n_units = T.meta_var(units(n_tok, n_seq))
        splits: T.let[T.int32] = num_splits(n_units, split_budget)
        for blk in T.thread_binding(n_units * kv_heads * splits, thread="blockIdx.x"):
            for lane in T.thread_binding(nt, thread="threadIdx.x"):
                with T.sblock("decode"):
                    T.reads()
                    T.writes()
                    q_sh = T.sblock_alloc_buffer((ROWS * d,), DTYPE, scope=sh)
                    k_sh = T.sblock_alloc_buffer((stages * keys * d,), DTYPE, scope=sh)
                    v_sh = T.sblock_alloc_buffer((stages * keys * d,), DTYPE, scope=sh)
                    o_acc = T.sblock_alloc_buffer((frag["o"],), "float32", scope="local")
                    s_acc = T.sblock_alloc_buffer((frag["s"],), "float32", scope="local")
                    p_frag = T.sblock_alloc_buffer((frag["s"],), DTYPE, scope="local")
                    a_frag = T.sblock_alloc_buffer((frag["a"],), DTYPE, scope="local")
                    b_frag = T.sblock_alloc_buffer((frag["b"],), DTYPE, scope="local")
                    row_pos = T.sblock_alloc_buffer((2,), "int32", scope="local")
                    m_run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    l_run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    m_new = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    info = T.sblock_alloc_buffer((5,), "int32", scope="local")
                    u: T.let[T.int32] = blk // (kv_heads * splits)
                    kvh: T.let[T.int32] = blk // splits % kv_heads
                    s: T.let[T.int32] = blk % splits
                    if ragged:
                        lo[0] = u
                    else:
                        seq_of_token(indptr, n_ptr - 1, u, lo, hi)
                    t: T.let[T.int32] = token_of(indptr, u)
                    # what depends on the search is stored, never let-bound: TVM's planner of
                    # dynamic shared memory refuses a local buffer read by a let at the top
                    info[0] = slots[lo[0]]
                    info[1] = split_pages(key_pages(positions[t]), splits, tp)[0]
                    info[2] = T.min(s * info[1], key_pages(positions[t]))
                    info[3] = T.min(info[2] + info[1], key_pages(positions[t]))
                    if ragged:  # a longer sequence's rows are the prefill kernel's: no tiles
                        if indptr[u + 1] - indptr[u] != 1:
                            info[3] = info[2]
                    if not ragged:  # (which waits for nothing: see the docstring)
                        # this step appends keys at its tokens' positions, the first of them
                        # its sequence's first token's: a tile wholly before it is no producer's
                        info[4] = T.Select(
                            (info[2] + tp) * PAGE_SIZE <= positions[indptr[lo[0]]], 1, 0
                        )
                    slot = T.meta_var(info[0])
                    p0 = T.meta_var(info[2])
                    p1 = T.meta_var(info[3])
                    n_tiles = T.meta_var((info[3] - info[2] + tp - 1) // tp)
                    early = T.meta_var(info[4] > 0)
                    layer64: T.let[T.int64] = T.Cast("int64", layer)
                    if ragged:  # no wait here: see the docstring
                        if n_tiles > 0:
                            load_kv(kp, vp, k_sh, v_sh, 0, p0, p1 - 1, lane, slot, table, kvh,
                                    layer64)  # fmt: skip
                    else:
                        if n_tiles > 0 and early:
                            load_kv(kp, vp, k_sh, v_sh, 0, p0, p1 - 1, lane, slot, table, kvh,
                                    layer64)  # fmt: skip
                        T.evaluate(wait_for_producers(True))
                        T.evaluate(release_dependents(True))
                        if n_tiles > 0 and not early:
                            load_kv(kp, vp, k_sh, v_sh, 0, p0, p1 - 1, lane, slot, table, kvh,
                                    layer64)  # fmt: skip
                    for it in T.unroll(q_copies):
                        x: T.let[T.int32] = it * nt + lane
                        r: T.let[T.int32] = x // dch
                        T.evaluate(
                            T.s_tir.cp_async_raw.legacy(
                                q_sh.data,
                                swizzled(r, x % dch, dch),
                                q.data,
                                (t * heads + kvh * group + r % group) * d + x % dch * 8,
                                16,
                                dtype=DTYPE,
                            )
                        )
                    T.evaluate(T.ptx["cp.async.commit_group"]())
                    # the ring's other stages but one: each a commit group, empty or not
                    for st in T.unroll(1, stages - 1):
                        if st < n_tiles:
                            load_kv(kp, vp, k_sh, v_sh, st, p0 + st * tp, p1 - 1, lane, slot,
                                    table, kvh, layer64)  # fmt: skip
                        T.evaluate(T.ptx["cp.async.commit_group"]())
                    for hr in T.unroll(2):
                        # keys of this piece up to the token's own (all rows: one token)
                        row_pos[hr] = T.min(positions[t], p1 * PAGE_SIZE - 1)
                        m_run[hr] = T.float32("-inf")
                        l_run[hr] = T.float32(0)
                    for i in T.unroll(frag["o"]):
                        o_acc[i] = T.float32(0)
                    for kt in T.serial(n_tiles):
                        # tile kt has landed; the barrier also retires the stage refilled next
                        T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
                        T.tvm_storage_sync("shared.dyn")
                        if kt + stages - 1 < n_tiles:
                            load_kv(kp, vp, k_sh, v_sh, (kt + stages - 1) % stages,
                                    p0 + (kt + stages - 1) * tp, p1 - 1, lane, slot, table, kvh,
                                    layer64)  # fmt: skip
                        T.evaluate(T.ptx["cp.async.commit_group"]())
                        attend_tile(q_sh, k_sh, v_sh, kt % stages, (p0 + kt * tp) * PAGE_SIZE,
                                    row_pos, s_acc, p_frag, a_frag, b_frag, o_acc, m_run, l_run,
                                    m_new, 0, lane)  # fmt: skip
                    for hr in T.unroll(2):
                        for sh_ in T.unroll(2):
                            l_run[hr] = l_run[hr] + lane_xor(l_run[hr], 1 << sh_)
                    # rows past the group repeat its heads: only the group's rows are stored
                    for nt8 in T.unroll(d // 8):
                        for e in T.unroll(4):
                            er, ec = T.meta_var(acc_coords(lane, e))
                            hd: T.let[T.int32] = kvh * group + er
                            col: T.let[T.int32] = nt8 * 8 + ec
                            if er < group and n_tiles > 0:
                                if splits == 1:
                                    o[t, hd, col] = finish(
                                        o_acc[nt8 * 4 + e] / l_run[e // 2],
                                        gate_value(gate, t, hd, col),
                                    )
                                else:
                                    ws_acc[u * splits + s, hd, col] = o_acc[nt8 * 4 + e]
                    for hr in T.unroll(2):
                        if lane % 4 == 0 and lane // 4 + hr * 8 < group and n_tiles > 0:
                            if splits > 1:
                                hd: T.let[T.int32] = kvh * group + lane // 4 + hr * 8
                                ws_ml[u * splits + s, hd, 0] = m_run[hr]
                                ws_ml[u * splits + s, hd, 1] = l_run[hr]
                    if ragged:  # beside the prefill kernel: see the docstring
                        wait_at_end(blk == 0 and lane == 0)
        merge(o, ws_acc, ws_ml, positions, gate, splits, n_units, indptr if ragged else None)

    if ragged:
        return attn_decode_mma.with_attr("global_symbol", "attn_decode_ragged")
    return attn_decode_mma
