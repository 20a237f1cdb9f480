"""A decode step's Gated DeltaNet core in one kernel: the conv1d, norms and gates of
gdn_prep.gdn_input, then the recurrent delta rule of gdn.gated_delta_rule, for one token a
sequence.

Each block of the delta rule owns ROWS value columns of one (sequence, head). Here it first
makes that token's inputs itself, from in_proj's row and the conv state: its k-head's q and k
(l2-normalised), its own value columns, g and beta. Blocks of one k-head make the same q and
k, which costs nothing next to the 8 KB of state each moves, and a decode step loses gdn_input's
launch and its q/k/v round trip. The conv state is only read here: blocks of one k-head all read
its q and k history, so none may shift it; gdn_prep.gated_norm does, after every block is done.
Its arithmetic follows gdn_input's and the delta rule's in order, sums included, so a decode
row's values equal those of the two kernels (bit for bit on the CPU).
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .gdn import PARTS, ROWS, RuleLayout, rule_phases
from .gdn_prep import beta_gate, conv_silu, l2_parts, log_decay
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

# decode_wide's block layout (8-64 sequences): 32 state rows a block, 4 threads a row. At 16
# and 64 sequences it streams the state at 69% and 72% of copy bandwidth against 65% and 66%
# for gdn.ROWS x gdn.PARTS (gdn_decode_kernel_layouts.json); at one sequence the 16-row blocks
# add less to a step (profile_step_gdn_layout.json), so decode keeps them.
WIDE_LAYOUT = {"rows": 32, "parts": 4}
NAME = "gdn_delta_rule_decode"


def decode_delta_rule(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    kernel: int,
    dtype: str,
    target: Target,
    rows: int = ROWS,
    parts: int = PARTS,
) -> PrimFunc:
    """(proj [batch, conv_dim + value_dim + 2 hv], conv weight, A_log, dt_bias, slots, conv
    pool (read), recurrent pool (updated in place), layer) -> o [batch, hv, dv] fp32: token b
    of sequence b, as gdn_input followed by gated_delta_rule would give, without the conv
    state's shift (gdn_prep.gated_norm's `conv` does it)."""
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
    shared = "shared" if gpu else "global"
    load_state, token_update, store_state = rule_phases(lay, gpu)
    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

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
        out_h: T.handle,
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
        out = T.match_buffer(out_h, (batch, v_heads, v_dim), "float32")
        for blk in grid(batch * v_heads * tiles):
            with T.sblock("delta_rule"):
                T.reads()
                T.writes()
                st = T.sblock_alloc_buffer((rows * (k_dim + 1),), "float32", scope=shared)
                kq = T.sblock_alloc_buffer((staged,), "float32", scope=shared)
                raw = T.sblock_alloc_buffer((2 * k_dim,), "float32", scope=shared)  # k, q
                red = T.sblock_alloc_buffer((2 * nt,), "float32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                b: T.let[T.int32] = blk // (v_heads * tiles)
                h: T.let[T.int32] = blk // tiles % v_heads
                col0: T.let[T.int32] = blk % tiles * rows
                kh: T.let[T.int32] = h // group
                slot: T.let[T.int32] = slots[b]
                load_state(pool, slot, layer, h, col0, st)
                # the token's inputs, staged as gated_delta_rule stages them: [k | q | v | g | beta]
                for tx in lanes():
                    with T.sblock("conv"):
                        T.reads()
                        T.writes()
                        win = T.sblock_alloc_buffer((kernel,), "float32", scope="local")
                        wt = T.sblock_alloc_buffer((kernel,), "float32", scope="local")
                        for e in T.unroll((made + nt - 1) // nt):
                            i: T.let[T.int32] = e * nt + tx
                            if i < made:
                                c: T.let[T.int32] = T.if_then_else(
                                    i < k_dim,
                                    key_dim + kh * k_dim + i,
                                    T.if_then_else(
                                        i < 2 * k_dim,
                                        kh * k_dim + i - k_dim,
                                        2 * key_dim + h * v_dim + col0 + i - 2 * k_dim,
                                    ),
                                )
                                for j in T.unroll(kernel):
                                    wt[j] = T.Cast("float32", w[c, j])
                                for j in T.unroll(hist):
                                    win[j] = T.Cast("float32", conv[slot, layer, c, j])
                                win[hist] = T.Cast("float32", x[b, c])
                                if i < 2 * k_dim:
                                    raw[i] = conv_silu(wt, win, kernel, dtype)
                                else:
                                    kq[i] = conv_silu(wt, win, kernel, dtype)
                        if tx == 0:
                            kq[made] = log_decay(
                                T.Cast("float32", x[b, conv_dim + value_dim + v_heads + h]),
                                a_log[h],
                                dt_bias[h],
                            )
                            kq[made + 1] = beta_gate(
                                T.Cast("float32", x[b, conv_dim + value_dim + h])
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
                token_update(st, kq, red, out, b, h, col0)
                store_state(pool, slot, layer, h, col0, st)

    # decode and decode_wide each hold their layout's kernel: one module, two symbols, named by
    # the layout RuleLayout settled on (rows fall back to a divisor of v_dim)
    name = NAME if (rows, lay.parts) == (ROWS, PARTS) else f"{NAME}_r{rows}p{lay.parts}"
    return gdn_delta_rule_decode.with_attr("global_symbol", name)
