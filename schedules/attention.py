"""Split-KV paged attention over the KV cache of schedules/kv_cache.py.

Token t attends to positions 0..positions[t] of its sequence, so causality inside a prefill
chunk, earlier chunks and decode are one rule; the step's own K/V were appended to the pages
first (`kv_cache.append_kv`).

`paged_attention` serves prefill and decode alike: a block owns (token, kv head, split) and all
`heads / kv_heads` query heads of that kv head, so each K/V element is loaded once for the
whole GQA group. The kv range of a token is cut into `splits` pieces (flash-decoding) when
there are few tokens, so one long sequence fills the GPU, each piece at least a tile of pages; a
second kernel in the same function merges the pieces that hold keys (attention_merge.py).
Per tile of keys (`tile_pages` pages, whose K and V are loaded together) the block runs four
phases: partial scores (a thread per key x dim slice), whole scores (a thread per head x key),
the online softmax (a thread per query head), and P.V (a thread per key group x 8-dim chunk,
accumulating in registers). Scores are kept in log2 units, so the softmax and the merge run on
exp2. On the CPU the same loop nest runs its lanes serially, so the CPU tests check the GPU
kernel's indexing.

Under dependent launch (schedules/pdl.py) both kernels do what needs no producer before their
wait: the split kernel finds its sequence, slot and pages from the step's inputs and prefetches
its first tile's K and V into L2; the merge reads positions and the output gates. So a
sequence's first tile is already in L2 when the producer ends (B1 L32k: 66.7 -> 75.5% of copy
bandwidth, docs/performance.md, session 19).
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .attention_merge import key_pages, merge_phase, split_pages
from .attention_prep import gate_column, gate_product
from .gdn_prep import rounded
from .kv_cache import PAGE_SIZE, seq_of_token
from .loops import block_loop, thread_loop
from .pdl import prefetch_l2, release_dependents, wait_for_producers

# Split pieces of all tokens together: with few tokens each one's kv range is cut so that
# tokens x splits stays at this many (x kv heads blocks), enough to fill an H200's 132 SMs.
SPLIT_BUDGET = 128
# 4 blocks an SM hide each other's phases (so at most 128 registers a thread)
BLOCKS_PER_SM = 4
LOG2E = 1.4426950408889634


def num_splits(n_tok, budget: int = SPLIT_BUDGET):
    """Pieces each token's kv range is cut into; a TIR expression of the token count."""
    return T.max(1, budget // n_tok)


def output_gate(head_dim: int, dtype: str) -> tuple:
    """(gate_value(gate, t, h, c): the fp32 gate of output (t, h, c) from qkv_proj's row,
    finish(value, gate): the stored output) of the kernels that gate o where they store it."""

    def gate_value(gate, t, h, c):
        return T.Cast("float32", gate[t, gate_column(h, head_dim) + c])

    def finish(val, g):
        return gate_product(rounded(val, dtype), g, dtype)

    return gate_value, finish


def _vector(head_dim: int) -> int:
    return next(v for v in (8, 4, 2, 1) if head_dim % v == 0)


def paged_attention(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    target: Target,
    tile_pages: int = 2,
    split_budget: int = SPLIT_BUDGET,
) -> PrimFunc:
    """o[t, h] = softmax(q[t, h] . K[0..pos_t] * head_dim^-0.5) V[0..pos_t] over the pages of
    t's sequence, times its output gate: (q, indptr, slots, positions, page_table, k_pool,
    v_pool, layer, qkv_proj's output, whose gates it reads) -> (o [n_tok, heads, head_dim],
    and two workspaces for the split pieces). The gate is applied where o is stored (its last
    piece merged), so the gated layer's output needs no kernel of its own."""
    if heads % kv_heads:
        raise ValueError(f"heads {heads} must be a multiple of kv_heads {kv_heads}")
    gpu = target.kind.name == "cuda"
    group, d, tj, tp = heads // kv_heads, head_dim, PAGE_SIZE, tile_pages
    vec = _vector(d)
    parts = min(8, d // vec)  # score phase: dim slices per key
    chunks = d // vec  # P.V phase: vec-wide dim chunks
    nt = tj * parts  # threads a block
    fits = chunks % nt == 0 if nt < chunks else nt % chunks == 0 and tj % (nt // chunks) == 0
    if not fits:
        raise ValueError(f"head_dim {d}: no thread layout for the P.V phase")
    key_groups = max(1, nt // chunks)  # P.V: keys split over this many thread groups
    keys_per_group = tj // key_groups
    chunk_passes = max(1, chunks // nt)
    per_part = d // parts // vec  # vec-wide loads per thread in the score phase
    # scores in log2 units: exp2 is one instruction, exp a dozen
    scale = float(d) ** -0.5 * LOG2E
    shared = "shared" if gpu else "global"
    ws_rows = split_budget

    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

    def own(tx, i, n):
        """A thread's private element i of n: registers on the GPU; on the CPU, where lanes
        run one after another in one buffer, the lane's own row."""
        return i if gpu else tx * n + i

    n_acc = chunk_passes * group * vec  # a thread's P.V accumulators
    kt = tp * tj  # keys a tile: `tp` pages a step, loaded together
    n_v = tp * chunk_passes * keys_per_group * vec  # a thread's share of a tile's V

    def v_at(u, cp, jj, i):
        return ((u * chunk_passes + cp) * keys_per_group + jj) * vec + i
    reg = "local" if gpu else "global"
    # the CPU keeps V in fp32: TVM's bf16 legalization loses a bf16 buffer shared by phases
    v_dtype = dtype if gpu else "float32"
    reg_rows = 1 if gpu else nt

    gate_value, finish = output_gate(d, dtype)

    # tile 0's K and V lines (128 bytes), prefetched into L2 before the wait
    line_elems = 128 // (2 if dtype == "bfloat16" else 4)
    page_lines = max(1, tj * d // line_elems)
    pf_lines = 2 * tp * page_lines

    def dim(p, e, i):
        """Score phase: dims of slice p, interleaved so a warp's loads cover whole rows."""
        return (e * parts + p) * vec + i

    chains = 4  # the softmax's independent max and sum chains (kt is a multiple of 16)
    merge = merge_phase(heads, d, nt, tp, ws_rows, gpu, gate_value, finish)

    @T.prim_func(s_tir=True)
    def attn_paged(
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
        q = T.match_buffer(q_h, (n_tok, heads, d), dtype)
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        positions = T.match_buffer(pos_h, (n_tok,), "int32")
        table = T.match_buffer(table_h, (n_slots, width_pt), "int32")
        kp = T.match_buffer(kp_h, (n_layers, n_pages, kv_heads, tj, d), dtype)
        vp = T.match_buffer(vp_h, (n_layers, n_pages, kv_heads, tj, d), dtype)
        gate = T.match_buffer(gate_h, (n_tok, g_width), dtype)
        o = T.match_buffer(o_h, (n_tok, heads, d), dtype)
        ws_acc = T.match_buffer(ws_acc_h, (ws_rows, heads, d), "float32")
        ws_ml = T.match_buffer(ws_ml_h, (ws_rows, heads, 2), "float32")
        splits: T.let[T.int32] = num_splits(n_tok, split_budget)
        for blk in grid(n_tok * kv_heads * splits):
            with T.sblock("attend"):
                T.reads()
                T.writes()
                if gpu:
                    T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", BLOCKS_PER_SM)
                q_sh = T.sblock_alloc_buffer((group * d,), "float32", scope=shared)
                part = T.sblock_alloc_buffer((group * kt * parts,), "float32", scope=shared)
                s_sh = T.sblock_alloc_buffer((group * kt,), "float32", scope=shared)
                p_sh = T.sblock_alloc_buffer((group * kt,), "float32", scope=shared)
                alpha = T.sblock_alloc_buffer((group,), "float32", scope=shared)
                ml_sh = T.sblock_alloc_buffer((group * 2,), "float32", scope=shared)
                red = T.sblock_alloc_buffer((key_groups * group * d,), "float32", scope=shared)
                acc = T.sblock_alloc_buffer(
                    (reg_rows * n_acc,), "float32", scope=reg
                )
                ml = T.sblock_alloc_buffer((reg_rows * 2,), "float32", scope=reg)
                vreg = T.sblock_alloc_buffer((reg_rows * n_v,), v_dtype, scope=reg)
                lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                t: T.let[T.int32] = blk // (kv_heads * splits)
                kvh: T.let[T.int32] = blk // splits % kv_heads
                s: T.let[T.int32] = blk % splits
                seq_of_token(indptr, n_ptr - 1, t, lo, hi)
                slot: T.let[T.int32] = slots[lo[0]]
                kv_len: T.let[T.int32] = positions[t] + 1
                n_kv_pages: T.let[T.int32] = key_pages(positions[t])
                per_split: T.let[T.int32] = split_pages(n_kv_pages, splits, tp)[0]
                layer64: T.let[T.int64] = T.Cast("int64", layer)
                p0: T.let[T.int32] = T.min(s * per_split, n_kv_pages)
                p1: T.let[T.int32] = T.min(p0 + per_split, n_kv_pages)
                # Before the wait: the step's inputs (indptr, slots, positions, the page table)
                # are no producer's (schedules/pdl.py), and an L2 prefetch only warms lines (the
                # producer may still write this step's keys), so tile 0 comes from L2 once the
                # wait returns; its page lookups then hit L1.
                for tx in lanes():
                    with T.sblock("prefetch"):
                        T.reads()
                        T.writes()
                        for e in T.unroll((pf_lines + nt - 1) // nt):
                            ln: T.let[T.int32] = e * nt + tx
                            u: T.let[T.int32] = ln // page_lines % tp
                            el: T.let[T.int32] = ln % page_lines * line_elems
                            if ln < pf_lines and p0 + u < p1:
                                pg: T.let[T.int64] = T.Cast("int64", table[slot, p0 + u])
                                if ln < pf_lines // 2:
                                    T.evaluate(prefetch_l2(gpu, T.address_of(
                                        kp[layer64, pg, kvh, el // d, el % d])))  # fmt: skip
                                else:
                                    T.evaluate(prefetch_l2(gpu, T.address_of(
                                        vp[layer64, pg, kvh, el // d, el % d])))  # fmt: skip
                T.evaluate(wait_for_producers(gpu))
                T.evaluate(release_dependents(gpu))
                for tx in lanes():
                    with T.sblock("init"):
                        T.reads()
                        T.writes()
                        for e in T.serial((group * d + nt - 1) // nt):
                            x: T.let[T.int32] = e * nt + tx
                            if x < group * d:
                                q_sh[x] = T.Cast("float32", q[t, kvh * group + x // d, x % d])
                        for x in T.serial(chunk_passes * group * vec):
                            acc[own(tx, x, n_acc)] = T.float32(0)
                        ml[own(tx, 0, 2)] = T.float32("-inf")
                        ml[own(tx, 1, 2)] = T.float32(0)
                lim: T.let[T.int32] = T.min(kv_len, p1 * tj)  # this split's keys end here
                for tl in T.serial((p1 - p0 + tp - 1) // tp):
                    key0: T.let[T.int32] = (p0 + tl * tp) * tj
                    # Phase 1: partial scores of key j over dim slice p, for every query head;
                    # the tile's V is loaded now too (phase 3's layout), so K and V are in
                    # flight together.
                    for tx in lanes():
                        with T.sblock("scores"):
                            T.reads()
                            T.writes()
                            kr = T.sblock_alloc_buffer((tp * per_part * vec,), dtype, scope="local")
                            sc = T.sblock_alloc_buffer((tp * group,), "float32", scope="local")
                            j: T.let[T.int32] = tx // parts
                            p: T.let[T.int32] = tx % parts
                            kg: T.let[T.int32] = tx // chunks if nt >= chunks else 0
                            for u in T.unroll(tp):
                                page: T.let[T.int64] = T.Cast(
                                    "int64", table[slot, T.min(p0 + tl * tp + u, p1 - 1)]
                                )
                                for e in T.unroll(per_part):
                                    for i in T.vectorized(vec):
                                        kr[(u * per_part + e) * vec + i] = kp[
                                            layer64, page, kvh, j, dim(p, e, i)
                                        ]
                                for cp in T.unroll(chunk_passes):
                                    for jj in T.unroll(keys_per_group):
                                        for i in T.vectorized(vec):
                                            vreg[own(tx, v_at(u, cp, jj, i), n_v)] = T.Cast(
                                                v_dtype,
                                                vp[
                                                    layer64,
                                                    page,
                                                    kvh,
                                                    kg * keys_per_group + jj,
                                                    (cp * nt + tx) % chunks * vec + i,
                                                ],
                                            )
                            for x in T.unroll(tp * group):
                                sc[x] = T.float32(0)
                            # each query value is read once and meets every page's key; the
                            # heads' sums are independent, so their FMA chains interleave
                            for e in T.unroll(per_part):
                                for i in T.unroll(vec):
                                    for g in T.unroll(group):
                                        qv: T.let[T.float32] = q_sh[g * d + dim(p, e, i)]
                                        for u in T.unroll(tp):
                                            sc[u * group + g] += qv * T.Cast(
                                                "float32", kr[(u * per_part + e) * vec + i]
                                            )
                            for u in T.unroll(tp):
                                for g in T.unroll(group):
                                    part[(g * kt + u * tj + j) * parts + p] = sc[u * group + g]
                    # Phase 2: whole scores, scaled and masked, one thread per (head, key).
                    for tx in lanes():
                        with T.sblock("score_sums"):
                            T.reads()
                            T.writes()
                            sv = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            for e in T.serial((group * kt + nt - 1) // nt):
                                x: T.let[T.int32] = e * nt + tx
                                if x < group * kt:
                                    sv[0] = T.float32(0)
                                    for p in T.unroll(parts):
                                        sv[0] += part[x * parts + p]
                                    s_sh[x] = T.Select(
                                        key0 + x % kt < lim,
                                        sv[0] * T.float32(scale),
                                        T.float32("-inf"),
                                    )
                    # Phase 3: the online softmax, one thread per query head.
                    for tx in lanes():
                        with T.sblock("softmax"):
                            T.reads()
                            T.writes()
                            mx = T.sblock_alloc_buffer((chains,), "float32", scope="local")
                            sm = T.sblock_alloc_buffer((chains,), "float32", scope="local")
                            if tx < group:
                                # 4 chains of max and of sum, not one serial chain of kt
                                for c in T.unroll(chains):
                                    mx[c] = ml[own(tx, 0, 2)]
                                    sm[c] = T.float32(0)
                                for jt in T.unroll(kt):
                                    mx[jt % chains] = T.max(mx[jt % chains], s_sh[tx * kt + jt])
                                for c in T.unroll(chains - 1):
                                    mx[0] = T.max(mx[0], mx[c + 1])
                                for jt in T.unroll(kt):
                                    pv: T.let[T.float32] = T.exp2(s_sh[tx * kt + jt] - mx[0])
                                    p_sh[tx * kt + jt] = pv
                                    sm[jt % chains] += pv
                                for c in T.unroll(chains - 1):
                                    sm[0] += sm[c + 1]
                                a: T.let[T.float32] = T.exp2(ml[own(tx, 0, 2)] - mx[0])
                                ml[own(tx, 1, 2)] = ml[own(tx, 1, 2)] * a + sm[0]
                                ml[own(tx, 0, 2)] = mx[0]
                                alpha[tx] = a
                    # Phase 4: acc = alpha acc + P V over this thread's keys and dim chunk.
                    for tx in lanes():
                        with T.sblock("pv"):
                            T.reads()
                            T.writes()
                            kg: T.let[T.int32] = tx // chunks if nt >= chunks else 0
                            for cp in T.serial(chunk_passes):
                                for g in T.serial(group):
                                    for i in T.unroll(vec):
                                        acc[own(tx, (cp * group + g) * vec + i, n_acc)] *= alpha[g]
                                for u in T.unroll(tp):
                                    for jj in T.unroll(keys_per_group):
                                        jt: T.let[T.int32] = u * tj + kg * keys_per_group + jj
                                        for g in T.serial(group):
                                            pj: T.let[T.float32] = p_sh[g * kt + jt]
                                            for i in T.unroll(vec):
                                                a_i: T.let[T.int32] = own(
                                                    tx, (cp * group + g) * vec + i, n_acc
                                                )
                                                vv: T.let[T.float32] = T.Cast(
                                                    "float32",
                                                    vreg[own(tx, v_at(u, cp, jj, i), n_v)],
                                                )
                                                acc[a_i] += pj * vv
                # Combine the key groups' accumulators; write o, or this split's piece.
                for tx in lanes():
                    with T.sblock("publish"):
                        T.reads()
                        T.writes()
                        kg: T.let[T.int32] = tx // chunks if nt >= chunks else 0
                        for cp in T.serial(chunk_passes):
                            c: T.let[T.int32] = (cp * nt + tx) % chunks
                            for g in T.serial(group):
                                for i in T.serial(vec):
                                    red[(kg * group + g) * d + c * vec + i] = acc[
                                        own(tx, (cp * group + g) * vec + i, n_acc)
                                    ]
                        if tx < group:
                            ml_sh[tx * 2] = ml[own(tx, 0, 2)]
                            ml_sh[tx * 2 + 1] = ml[own(tx, 1, 2)]
                for tx in lanes():
                    with T.sblock("store"):
                        T.reads()
                        T.writes()
                        sum_ = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        for e in T.serial((group * d + nt - 1) // nt):
                            x: T.let[T.int32] = e * nt + tx
                            if x < group * d:
                                g: T.let[T.int32] = x // d
                                sum_[0] = T.float32(0)
                                for kg in T.serial(key_groups):
                                    sum_[0] += red[(kg * group + g) * d + x % d]
                                if splits == 1:
                                    hd: T.let[T.int32] = kvh * group + g
                                    o[t, hd, x % d] = finish(
                                        sum_[0] / ml_sh[g * 2 + 1], gate_value(gate, t, hd, x % d)
                                    )
                                else:
                                    ws_acc[t * splits + s, kvh * group + g, x % d] = sum_[0]
                                    if x % d == 0:
                                        ws_ml[t * splits + s, kvh * group + g, 0] = ml_sh[g * 2]
                                        ws_ml[t * splits + s, kvh * group + g, 1] = ml_sh[
                                            g * 2 + 1
                                        ]
        merge(o, ws_acc, ws_ml, positions, gate, splits, n_tok, None)

    return attn_paged
