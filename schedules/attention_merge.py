"""The merge of paged_attention's split pieces (schedules/attention.py), and how a token's keys
are cut into them: a token's kv range is cut into pieces of at least a tile of pages, each
piece's block leaves its running (max, sum, P.V) in a workspace row, and a second kernel of the
same function merges the pieces that hold keys and stores the gated output."""

from __future__ import annotations

from tvm.script import tirx as T

from .kv_cache import PAGE_SIZE
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

MERGE_UNROLL = 8  # a thread's workspace loads in flight, of a few pieces
MANY_PIECES_UNROLL = 16  # of many: a group's share of 128 pieces in one round of loads
MERGE_COLS = 16  # merge of many pieces: columns a block


def key_pages(position):
    """Pages of keys a token at `position` attends to (positions 0..position)."""
    return (position + PAGE_SIZE) // PAGE_SIZE


def split_pages(n_pages, splits, min_pages: int):
    """(pages a piece, pieces holding keys) of a token with `n_pages` pages of keys, a piece at
    least `min_pages` (a tile's): a one-page piece would load its page twice (a tile clamps to
    its piece), and every piece costs the merge a read. A short context is cut into fewer
    pieces; its other blocks find no keys, and the merge skips them."""
    per_split = T.max((n_pages + splits - 1) // splits, min_pages)
    return per_split, T.max(1, (n_pages + per_split - 1) // per_split)


@T.macro
def merge_pieces(ws_acc, ws_ml, row0, h, col, first, stride, pieces, run, ms, ls, xs, unroll):
    # pieces first, first + stride, ... (of `pieces`, from workspace row row0) of column
    # col of head h into a running (max, numerator, denominator), `unroll` loads in flight
    # at a time
    run[0] = T.float32("-inf")
    run[1] = T.float32(0)
    run[2] = T.float32(0)
    for s0 in T.serial((pieces - first + stride * unroll - 1) // (stride * unroll)):
        for u in T.unroll(unroll):
            sp: T.let[T.int32] = T.min((s0 * unroll + u) * stride + first, pieces - 1)
            ms[u] = ws_ml[row0 + sp, h, 0]
            ls[u] = ws_ml[row0 + sp, h, 1]
            xs[u] = ws_acc[row0 + sp, h, col]
        for u in T.unroll(unroll):
            sp: T.let[T.int32] = (s0 * unroll + u) * stride + first
            # empty pieces (max -inf) and clamped repeats add nothing
            if sp < pieces and ms[u] > T.float32("-inf"):
                mn: T.let[T.float32] = T.max(run[0], ms[u])
                ca: T.let[T.float32] = T.exp2(run[0] - mn)
                cb: T.let[T.float32] = T.exp2(ms[u] - mn)
                run[1] = run[1] * ca + cb * xs[u]
                run[2] = run[2] * ca + cb * ls[u]
                run[0] = mn


def merge_phase(
    heads: int,
    d: int,
    nt: int,
    tile_pages: int,
    ws_rows: int,
    gpu: bool,
    gate_value,
    finish,
):
    """The merge kernel as a macro (o, ws_acc, ws_ml, positions, gate, splits, n_units, indptr)
    for blocks of `nt` threads; `gate_value(gate, t, h, c)` is an output's gate (fp32),
    `finish(value, gate)` the stored output. The pieces' maxima are in log2 units. A unit (a
    workspace row's owner) is a token, or with `indptr` a sequence, whose token is its first,
    and which only a one-token sequence has (attention_decode_mma's ragged form)."""
    dm, tp = MERGE_COLS, tile_pages
    if nt % dm:
        raise ValueError(f"{nt} threads a block do not split into groups of {dm} columns")
    shared = "shared" if gpu else "global"
    reg, reg_rows = ("local", 1) if gpu else ("global", nt)
    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

    def own(tx):
        return 0 if gpu else tx

    def token(indptr, u):
        return u if indptr is None else indptr[u]

    def single(indptr, u):
        return True if indptr is None else indptr[u + 1] - indptr[u] == 1

    @T.macro
    def merge_inputs(positions, gate, splits, mb, cols, n_cols, live, g_val, indptr):
        # a thread's pieces holding keys (its group's column) and its stored column's gate
        for tx in lanes():
            with T.sblock("merge_inputs"):
                T.reads()
                T.writes()
                x: T.let[T.int32] = mb * cols + tx % cols
                live[own(tx)] = 0
                if x < n_cols and splits > 1:
                    if single(indptr, x // (heads * d)):
                        t: T.let[T.int32] = token(indptr, x // (heads * d))
                        live[own(tx)] = split_pages(key_pages(positions[t]), splits, tp)[1]
                y: T.let[T.int32] = mb * cols + tx
                if tx < cols and y < n_cols and splits > 1:
                    ty: T.let[T.int32] = token(indptr, y // (heads * d))
                    g_val[own(tx)] = gate_value(gate, ty, y // d % heads, y % d)

    @T.macro
    def merge(o, ws_acc, ws_ml, positions, gate, splits, n_units, indptr):
        # Merge the split pieces, a block per `cols` output columns (of the flattened [token,
        # head, dim] output) split over `groups` thread groups that take the pieces
        # round-robin, then combined in shared memory. Many pieces (few tokens): 16 columns,
        # many groups; a few pieces: a column a thread, all pieces at once. Nothing to do with
        # one split (tested inside each phase: a barrier may not fall inside a condition).
        cols: T.let[T.int32] = T.Select(splits > MERGE_UNROLL, dm, nt)
        groups: T.let[T.int32] = nt // cols
        n_cols: T.let[T.int32] = T.min(n_units, ws_rows) * heads * d
        for mb in grid((n_cols + cols - 1) // cols):
            with T.sblock("merge"):
                T.reads()
                T.writes()
                m_sh = T.sblock_alloc_buffer((nt,), "float32", scope=shared)
                n_sh = T.sblock_alloc_buffer((nt,), "float32", scope=shared)
                d_sh = T.sblock_alloc_buffer((nt,), "float32", scope=shared)
                live = T.sblock_alloc_buffer((reg_rows,), "int32", scope=reg)
                g_val = T.sblock_alloc_buffer((reg_rows,), "float32", scope=reg)
                # the pieces' count (from positions, a step input) and the gate (qkv_proj's,
                # two kernels back) are not the split kernel's: read before the wait
                merge_inputs(positions, gate, splits, mb, cols, n_cols, live, g_val, indptr)
                T.evaluate(wait_for_producers(gpu))  # schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                for tx in lanes():
                    with T.sblock("merge_groups"):
                        T.reads()
                        T.writes()
                        run = T.sblock_alloc_buffer((3,), "float32", scope="local")
                        ms = T.sblock_alloc_buffer((MANY_PIECES_UNROLL,), "float32", scope="local")
                        ls = T.sblock_alloc_buffer((MANY_PIECES_UNROLL,), "float32", scope="local")
                        xs = T.sblock_alloc_buffer((MANY_PIECES_UNROLL,), "float32", scope="local")
                        x: T.let[T.int32] = mb * cols + tx % cols
                        if x < n_cols and splits > MERGE_UNROLL:  # a group's pieces: 1 round
                            merge_pieces(ws_acc, ws_ml, x // (heads * d) * splits, x // d % heads,
                                         x % d, tx // cols, groups, live[own(tx)], run, ms, ls,
                                         xs, MANY_PIECES_UNROLL)  # fmt: skip
                        elif x < n_cols and splits > 1:
                            merge_pieces(ws_acc, ws_ml, x // (heads * d) * splits, x // d % heads,
                                         x % d, tx // cols, groups, live[own(tx)], run, ms, ls,
                                         xs, MERGE_UNROLL)  # fmt: skip
                        if x < n_cols and splits > 1:
                            m_sh[tx] = run[0]
                            n_sh[tx] = run[1]
                            d_sh[tx] = run[2]
                for tx in lanes():
                    with T.sblock("merge_store"):
                        T.reads()
                        T.writes()
                        tot = T.sblock_alloc_buffer((3,), "float32", scope="local")
                        x: T.let[T.int32] = mb * cols + tx
                        if tx < cols and x < n_cols and splits > 1:
                            if single(indptr, x // (heads * d)):  # else no unit's: ragged
                                tot[0] = T.float32("-inf")
                                for g in T.serial(groups):
                                    tot[0] = T.max(tot[0], m_sh[g * cols + tx])
                                tot[1] = T.float32(0)
                                tot[2] = T.float32(0)
                                for g in T.serial(groups):
                                    w: T.let[T.float32] = T.exp2(m_sh[g * cols + tx] - tot[0])
                                    tot[1] += w * n_sh[g * cols + tx]
                                    tot[2] += w * d_sh[g * cols + tx]
                                o[token(indptr, x // (heads * d)), x // d % heads, x % d] = finish(
                                    tot[1] / tot[2], g_val[own(tx)]
                                )

    return merge
