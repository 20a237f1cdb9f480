"""A decode step's Gated DeltaNet core in one kernel: the conv1d, norms and gates of
gdn_prep.gdn_input, the recurrent delta rule of gdn.gated_delta_rule and the gated RMSNorm of
gdn_prep.gated_norm, for one token a sequence.

Each block of the delta rule owns ROWS value columns of one (sequence, head). Here it first
makes that token's inputs itself, from in_proj's row and the conv state: its k-head's q and k
(l2-normalised), its own value columns, g and beta. Blocks of one k-head make the same q and
k, which costs nothing next to the 8 KB of state each moves, and a decode step loses gdn_input's
launch and its q/k/v round trip. Its arithmetic follows gdn_input's, the delta rule's and
gated_norm's in order, sums included, so a decode row's values equal those of the three kernels
(bit for bit on the CPU).

The gated norm of a head needs all of its value columns, which several blocks make, and the
conv state's q/k history may move on only after every block of the k-head has read it. On the
GPU the last block to finish takes each over, found by a ticket: an int32 a (slot, k-head) and
a (slot, head) that every block of it adds one to, and the last resets. That spares decode the
norm kernel behind this one (~2.5 µs a layer at one sequence); decode_wide's blocks, in two
waves, lose more to the tickets than that, so its kernel leaves the norm to gated_norm
(`gated`). A block moves its own value columns' history itself: no other block reads them.
The CPU runs the two as loop nests after the blocks'.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .gdn import PARTS, ROWS, RuleLayout, rule_phases
from .gdn_decode_tail import head_norm_macro, history_macros
from .gdn_prep import beta_gate, conv_silu, head_norm_layout, l2_parts, log_decay
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_at_end, wait_for_producers

# decode_wide's block layout (8-64 sequences): 32 state rows a block, 4 threads a row. At 16
# and 64 sequences it streams the state at 69% and 72% of copy bandwidth against 65% and 66%
# for gdn.ROWS x gdn.PARTS (gdn_decode_kernel_layouts.json); at one sequence the 16-row blocks
# add less to a step (profile_step_gdn_layout.json), so decode keeps them.
WIDE_LAYOUT = {"rows": 32, "parts": 4}
NAME = "gdn_delta_rule_decode"


def token_row(indptr, b):
    """Sequence b's token row: b in a decode batch, its first token in a ragged batch."""
    return b if indptr is None else indptr[b]


def single_token(indptr, b):
    """Whether sequence b is this kernel's: always in a decode batch, in a ragged batch only
    where it has one token."""
    return True if indptr is None else indptr[b + 1] - indptr[b] == 1


def tickets_shape(k_heads: int, v_heads: int, num_slots) -> tuple:
    """The tickets the kernel counts its blocks with: [slots, k-heads + heads] int32, zero
    between kernels."""
    return (num_slots, k_heads + v_heads)


def decode_delta_rule(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    kernel: int,
    eps: float,
    dtype: str,
    target: Target,
    rows: int = ROWS,
    parts: int = PARTS,
    gated: bool = True,
    ragged: bool = False,
    beside: bool = False,
    o_dtype: str = "float32",
) -> PrimFunc:
    """With `gated`: (proj [batch, conv_dim + value_dim + 2 hv], conv weight, A_log, dt_bias,
    norm weight [dv], slots, conv pool, recurrent pool, tickets (the three updated in place),
    layer) -> o [batch, hv, dv] fp32 (the delta rule's output, a workspace), out [batch, hv *
    dv] (the gated norm's, out_proj's input): token b of sequence b as gdn_input,
    gated_delta_rule and gated_norm would give them.

    Without: (proj, conv weight, A_log, dt_bias, slots, conv pool (read only), recurrent pool,
    layer) -> o, which gated_norm takes on (and moves the conv history). decode_wide's kernel:
    at 16 sequences its 2,048 blocks run in two waves, and the tickets' fence and atomics
    lengthen every block (c16 TPOT 4.254 -> 4.358 ms gated, engine_gdn_fused_norm.json).

    `ragged` (without `gated`): (proj [n_tok, width], conv weight, A_log, dt_bias, indptr,
    slots, conv pool, recurrent pool, layer) -> o [n_tok, hv, dv]: a prefill's sequences of
    one token (a mixed step's decode rows) take this kernel, every other sequence's blocks
    run on without reading or writing state or o (barriers may not sit under a branch), and
    the two passes skip the single tokens in turn (gdn_chunked.MIXED_ROWS_RECURRENT). The
    passes' chunk machinery costs a whole chunk a sequence: 16 decode rows beside a prompt
    chunk cost 2.0 ms of a step there (profile_step_mixed16_s16.json), against ~0.6 ms for
    decode_wide's 16 rows here.

    `o_dtype` (without `gated`): o's dtype (gdn_chunked.core_out_dtype).

    `beside` (ragged only): launched after the two passes, it runs beside the scan (no wait
    before it starts; thread 0 of block 0 waits after its last store: schedules/pdl.py), writing
    its rows of the scan's o in place (gdn_chunked.MIXED_ROWS_BESIDE_SCAN)."""
    if ragged and gated:
        raise ValueError("the ragged kernel leaves the gated norm to gated_norm")
    if beside and not ragged:
        raise ValueError("only the ragged kernel runs beside the scan")
    if gated and o_dtype != "float32":
        raise ValueError("the gated kernel's o is its own fp32 workspace")
    hist = kernel - 1
    key_dim, value_dim = k_heads * k_dim, v_heads * v_dim
    conv_dim = 2 * key_dim + value_dim
    width = conv_dim + value_dim + 2 * v_heads
    group = v_heads // k_heads
    gpu = target.kind.name == "cuda"
    lay = RuleLayout.of(k_dim, v_dim, rows, parts)
    rows, nt, staged = lay.rows, lay.threads, lay.staged
    made = lay.g_at  # conv channels a block makes: its k, q and value columns, staged first
    tiles = v_dim // rows
    np_ = l2_parts(k_dim, v_dim)
    _, norm_lanes, norm_parts = head_norm_layout(v_heads, v_dim)
    assert norm_parts <= nt, "a head's partial sums need a lane each"
    shared = "shared" if gpu else "global"
    load_state, token_update, store_state = rule_phases(lay, gpu)
    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)
    windows = (made + nt - 1) // nt  # conv windows a lane makes

    channel, shift_history, shift_qk = history_macros(k_dim, key_dim, v_dim, hist, nt, lanes,
                                                      staged=gpu)  # fmt: skip
    head_norm = head_norm_macro(v_dim, conv_dim, norm_lanes, norm_parts, eps, dtype, nt, lanes, gpu)

    @T.macro
    def blocks(x, w, a_log, dt_bias, nw, indptr, slots, conv, pool, tickets, layer, o_ws, out,
               batch, gated):  # fmt: skip
        for blk in grid(batch * v_heads * tiles):
            with T.sblock("delta_rule"):
                T.reads()
                T.writes()
                st = T.sblock_alloc_buffer((rows * (k_dim + 1),), "float32", scope=shared)
                kq = T.sblock_alloc_buffer((staged,), "float32", scope=shared)
                raw = T.sblock_alloc_buffer((2 * k_dim,), "float32", scope=shared)  # k, q
                red = T.sblock_alloc_buffer((2 * nt,), "float32", scope=shared)
                vals = T.sblock_alloc_buffer((norm_lanes,), "float32", scope=shared)
                part = T.sblock_alloc_buffer((norm_parts,), "float32", scope=shared)
                inv = T.sblock_alloc_buffer((1,), "float32", scope=shared)
                ticket = T.sblock_alloc_buffer((2,), "int32", scope=shared)
                # the gated tail's inputs, staged on the way (gdn_decode_tail): the k-head's new
                # q/k history and the head's gate input
                moved = T.sblock_alloc_buffer((2 * k_dim * hist,), "float32", scope=shared)
                gate = T.sblock_alloc_buffer((v_dim,), "float32", scope=shared)
                b: T.let[T.int32] = blk // (v_heads * tiles)
                h: T.let[T.int32] = blk // tiles % v_heads
                col0: T.let[T.int32] = blk % tiles * rows
                kh: T.let[T.int32] = h // group
                slot: T.let[T.int32] = slots[b]
                row: T.let[T.int32] = token_row(indptr, b)
                # ragged: a longer sequence's blocks run on (every phase holds barriers, which
                # may not sit under a branch) but neither read nor write its state or o
                mine = T.meta_var(single_token(indptr, b))
                # before the wait (schedules/pdl.py): the state, the conv history and the slots
                # were written two or more kernels back, so their loads overlap in_proj's tail
                load_state(pool, slot, layer, h, col0, st, mine)
                # the token's inputs, staged as gated_delta_rule stages them: [k q v g beta]
                for tx in lanes():
                    with T.sblock("conv"):
                        T.reads()
                        T.writes()
                        wts = T.sblock_alloc_buffer((windows, kernel), "float32", scope="local")
                        wins = T.sblock_alloc_buffer((windows, kernel), "float32", scope="local")
                        wt = T.sblock_alloc_buffer((kernel,), "float32", scope="local")
                        win = T.sblock_alloc_buffer((kernel,), "float32", scope="local")
                        for e in T.unroll(windows):
                            i: T.let[T.int32] = e * nt + tx
                            if i < made:
                                c: T.let[T.int32] = channel(i, kh, h, col0)
                                for j in T.unroll(kernel):
                                    wts[e, j] = T.Cast("float32", w[c, j])
                                for j in T.unroll(hist):
                                    wins[e, j] = T.Cast("float32", conv[slot, layer, c, j])
                        T.evaluate(wait_for_producers(gpu and not beside))
                        T.evaluate(release_dependents(gpu and not beside))
                        for e in T.unroll(windows):
                            i: T.let[T.int32] = e * nt + tx
                            if i < made:
                                c: T.let[T.int32] = channel(i, kh, h, col0)
                                for j in T.unroll(kernel):
                                    wt[j] = wts[e, j]
                                    win[j] = wins[e, j]
                                win[hist] = T.Cast("float32", x[row, c])
                                if i < 2 * k_dim:
                                    raw[i] = conv_silu(wt, win, kernel, dtype)
                                    if gated and gpu:
                                        for j in T.unroll(hist):
                                            moved[i * hist + j] = win[j + 1]
                                else:
                                    kq[i] = conv_silu(wt, win, kernel, dtype)
                                    if gated:  # only this block reads its values' history
                                        shift_history(conv, x, b, slot, layer, c)
                        if gated and gpu:
                            for e in T.unroll((v_dim + nt - 1) // nt):
                                if e * nt + tx < v_dim:
                                    gate[e * nt + tx] = T.Cast(
                                        "float32", x[row, conv_dim + h * v_dim + e * nt + tx]
                                    )
                        if tx == 0:
                            kq[made] = log_decay(
                                T.Cast("float32", x[row, conv_dim + value_dim + v_heads + h]),
                                a_log[h],
                                dt_bias[h],
                            )
                            kq[made + 1] = beta_gate(
                                T.Cast("float32", x[row, conv_dim + value_dim + h])
                            )
                # l2 norms of k and q, summed in gdn_input's order (gdn_prep.l2_parts)
                for tx in lanes():
                    with T.sblock("squares"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        if tx < 2 * np_:
                            acc[0] = T.float32(0)
                            for j in T.serial((k_dim + np_ - 1) // np_):
                                if j * np_ + tx % np_ < k_dim:
                                    sv: T.let[T.float32] = raw[
                                        tx // np_ * k_dim + j * np_ + tx % np_
                                    ]
                                    acc[0] = acc[0] + sv * sv
                            red[tx] = acc[0]
                for tx in lanes():
                    with T.sblock("normalise"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        for e in T.unroll((2 * k_dim + nt - 1) // nt):
                            i: T.let[T.int32] = e * nt + tx
                            if i < 2 * k_dim:
                                acc[0] = T.float32(0)
                                for p in T.unroll(np_):
                                    acc[0] = acc[0] + red[i // k_dim * np_ + p]
                                kq[i] = raw[i] * (T.float32(1) / T.sqrt(acc[0] + T.float32(1e-6)))
                token_update(st, kq, red, o_ws, row, h, col0, mine)
                if gated and gpu:
                    # the block's o written and its q/k history read (the barrier), then a
                    # ticket's acquire-release add publishes them all and orders the last block's
                    # reads of the other blocks' o after it (CUTLASS's semaphores do the same)
                    T.tvm_storage_sync("shared")
                    for tx in lanes():
                        with T.sblock("tickets"):
                            T.reads()
                            T.writes()
                            taken = T.sblock_alloc_buffer((1,), "int32", scope="local")
                            if tx < 2:
                                at: T.let[T.int32] = T.if_then_else(tx == 0, kh, k_heads + h)
                                T.ptx.atom.acq_rel.gpu.global_.add.s32(
                                    taken[0], T.address_of(tickets[slot, at]), 1
                                )
                                ticket[tx] = taken[0]
                store_state(pool, slot, layer, h, col0, st, mine)
                if gated and gpu:
                    last_of_k: T.let[T.bool] = ticket[0] == group * tiles - 1
                    last_of_head: T.let[T.bool] = ticket[1] == tiles - 1
                    head_norm(o_ws, x, gate, nw, out, vals, part, inv, b, h, last_of_head)
                    shift_qk(conv, x, moved, b, slot, layer, kh, last_of_k)
                    for tx in lanes():
                        with T.sblock("reset"):
                            T.reads()
                            T.writes()
                            if tx == 0:
                                if last_of_k:
                                    tickets[slot, kh] = 0
                                if last_of_head:
                                    tickets[slot, k_heads + h] = 0
                if beside and gpu:
                    # beside the scan (see the docstring): one thread waits for it, so this
                    # grid ends after the scan's and its dependents see both
                    for tx in lanes():
                        with T.sblock("join"):
                            T.reads()
                            T.writes()
                            wait_at_end(blk == 0 and tx == 0)
        if gated and not gpu:  # the blocks' ends, after all of them (a nest is a barrier)
            for bh in grid(batch * v_heads):
                with T.sblock("gated_norm"):
                    T.reads()
                    T.writes()
                    vals = T.sblock_alloc_buffer((norm_lanes,), "float32", scope=shared)
                    part = T.sblock_alloc_buffer((norm_parts,), "float32", scope=shared)
                    inv = T.sblock_alloc_buffer((1,), "float32", scope=shared)
                    head_norm(o_ws, x, None, nw, out, vals, part, inv, bh // v_heads,
                              bh % v_heads, True)  # fmt: skip
            for bk in grid(batch * k_heads):
                with T.sblock("qk_shift"):
                    T.reads()
                    T.writes()
                    shift_qk(conv, x, None, bk // k_heads, slots[bk // k_heads], layer,
                             bk % k_heads, True)  # fmt: skip

    @T.prim_func(s_tir=True)
    def gdn_delta_rule_decode_gated(
        x_h: T.handle,
        w_h: T.handle,
        a_log_h: T.handle,
        dt_bias_h: T.handle,
        nw_h: T.handle,
        slots_h: T.handle,
        conv_h: T.handle,
        pool_h: T.handle,
        tickets_h: T.handle,
        layer: T.int32,
        o_ws_h: T.handle,
        out_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch, n_slots, n_layers = T.int32(), T.int32(), T.int32()
        c_slots, c_layers, t_slots = T.int32(), T.int32(), T.int32()
        x = T.match_buffer(x_h, (batch, width), dtype)
        w = T.match_buffer(w_h, (conv_dim, kernel), dtype)
        a_log = T.match_buffer(a_log_h, (v_heads,), "float32")
        dt_bias = T.match_buffer(dt_bias_h, (v_heads,), "float32")
        nw = T.match_buffer(nw_h, (v_dim,), "float32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        conv = T.match_buffer(conv_h, (c_slots, c_layers, conv_dim, hist), dtype)
        pool = T.match_buffer(pool_h, (n_slots, n_layers, v_heads, v_dim, k_dim), "float32")
        tickets = T.match_buffer(tickets_h, (t_slots, k_heads + v_heads), "int32")
        o_ws = T.match_buffer(o_ws_h, (batch, v_heads, v_dim), "float32")
        out = T.match_buffer(out_h, (batch, value_dim), dtype)
        blocks(x, w, a_log, dt_bias, nw, None, slots, conv, pool, tickets, layer, o_ws, out, batch,
               True)  # fmt: skip

    @T.prim_func(s_tir=True)
    def gdn_delta_rule_decode(
        x_h: T.handle,
        w_h: T.handle,
        a_log_h: T.handle,
        dt_bias_h: T.handle,
        slots_h: T.handle,
        conv_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        o_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch, n_slots, n_layers = T.int32(), T.int32(), T.int32()
        c_slots, c_layers = T.int32(), T.int32()
        x = T.match_buffer(x_h, (batch, width), dtype)
        w = T.match_buffer(w_h, (conv_dim, kernel), dtype)
        a_log = T.match_buffer(a_log_h, (v_heads,), "float32")
        dt_bias = T.match_buffer(dt_bias_h, (v_heads,), "float32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        conv = T.match_buffer(conv_h, (c_slots, c_layers, conv_dim, hist), dtype)
        pool = T.match_buffer(pool_h, (n_slots, n_layers, v_heads, v_dim, k_dim), "float32")
        o = T.match_buffer(o_h, (batch, v_heads, v_dim), o_dtype)
        blocks(x, w, a_log, dt_bias, None, None, slots, conv, pool, None, layer, o, None, batch,
               False)  # fmt: skip

    @T.prim_func(s_tir=True)
    def gdn_delta_rule_decode_ragged(
        x_h: T.handle,
        w_h: T.handle,
        a_log_h: T.handle,
        dt_bias_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        conv_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        o_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, batch, n_ptr = T.int32(), T.int32(), T.int32()
        n_slots, n_layers, c_slots, c_layers = T.int32(), T.int32(), T.int32(), T.int32()
        x = T.match_buffer(x_h, (n_tok, width), dtype)
        w = T.match_buffer(w_h, (conv_dim, kernel), dtype)
        a_log = T.match_buffer(a_log_h, (v_heads,), "float32")
        dt_bias = T.match_buffer(dt_bias_h, (v_heads,), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        conv = T.match_buffer(conv_h, (c_slots, c_layers, conv_dim, hist), dtype)
        pool = T.match_buffer(pool_h, (n_slots, n_layers, v_heads, v_dim, k_dim), "float32")
        o = T.match_buffer(o_h, (n_tok, v_heads, v_dim), o_dtype)
        blocks(x, w, a_log, dt_bias, None, indptr, slots, conv, pool, None, layer, o, None, batch,
               False)  # fmt: skip

    # decode and decode_wide each hold their layout's kernel: one module, two symbols, named by
    # the layout RuleLayout settled on (rows fall back to a divisor of v_dim)
    name = NAME if (rows, lay.parts) == (ROWS, PARTS) else f"{NAME}_r{rows}p{lay.parts}"
    if ragged:
        return gdn_delta_rule_decode_ragged.with_attr("global_symbol", name + "_ragged")
    if gated:
        return gdn_delta_rule_decode_gated.with_attr("global_symbol", name + "_gated")
    return gdn_delta_rule_decode.with_attr("global_symbol", name)
