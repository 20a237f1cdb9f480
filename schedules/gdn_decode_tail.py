"""The pieces of decode's GDN kernel (schedules/gdn_decode.py) that move a token's conv history
and finish a head's gated norm: which conv channel a block's staged input is, the shift of a
channel's history, the shift of a k-head's q/k history (by the k-head's last block on the GPU),
and gated_norm's arithmetic for a whole head (by the head's last block). Closures over the
kernel's sizes and lanes, made once a kernel.

On the GPU a last block's work is the kernel's critical path, so it reads nothing from global
memory it could have read earlier: each block stages its k-head's new q/k history and its
head's gate input in shared memory while it makes its inputs, and the last block shifts and
gates from there. The CPU's nests, after every block, read them from memory."""

from __future__ import annotations

from collections.abc import Callable

from tvm.script import tirx as T

from .gdn_prep import head_norms, norm_gate, rounded


def history_macros(
    k_dim: int, key_dim: int, v_dim: int, hist: int, nt: int, lanes: Callable, staged: bool
) -> tuple[Callable, Callable, Callable]:
    """(channel(i, kh, h, col0), shift_history(conv, x, b, slot, layer, c),
    shift_qk(conv, x, moved, b, slot, layer, kh, active)) for blocks of `nt` lanes. With
    `staged`, shift_qk writes channel i's new history from moved[i * hist : (i + 1) * hist]
    (fp32, as the block staged it); else it shifts conv and reads x."""

    def channel(i, kh, h, col0):
        # the conv channel of staged input i: k, then q of k-head kh, then the block's values
        return T.if_then_else(
            i < k_dim,
            key_dim + kh * k_dim + i,
            T.if_then_else(
                i < 2 * k_dim,
                kh * k_dim + i - k_dim,
                2 * key_dim + h * v_dim + col0 + i - 2 * k_dim,
            ),
        )

    @T.macro
    def shift_history(conv, x, b, slot, layer, c):
        # the window's newest kernel - 1 inputs become channel c's history (each read first)
        for j in T.unroll(hist - 1):
            conv[slot, layer, c, j] = conv[slot, layer, c, j + 1]
        conv[slot, layer, c, hist - 1] = x[b, c]

    @T.macro
    def shift_qk(conv, x, moved, b, slot, layer, kh, active):
        for tx in lanes():
            with T.sblock("qk_history"):
                T.reads()
                T.writes()
                for e in T.unroll((2 * k_dim + nt - 1) // nt):
                    i: T.let[T.int32] = e * nt + tx
                    if active:
                        if i < 2 * k_dim:  # k-head kh's k and q channels
                            c: T.let[T.int32] = channel(i, kh, 0, 0)
                            if staged:
                                for j in T.unroll(hist):
                                    conv[slot, layer, c, j] = T.Cast(
                                        conv.dtype, moved[i * hist + j]
                                    )
                            else:
                                shift_history(conv, x, b, slot, layer, c)

    return channel, shift_history, shift_qk


def head_norm_macro(
    v_dim: int,
    conv_dim: int,
    norm_lanes: int,
    norm_parts: int,
    eps: float,
    dtype: str,
    nt: int,
    lanes: Callable,
    gpu: bool,
) -> Callable:
    """head_norm(o_ws, x, gate, nw, out, vals, part, inv, b, h, active): gated_norm's
    arithmetic for head h of token b, from the whole head's o (which other blocks wrote). On
    the GPU the gate's input is gate[c] (fp32, staged by the block); on the CPU, x."""
    norms = head_norms(1, norm_parts, norm_lanes, v_dim, eps, lanes)

    def gate_input(x, gate, b, h, c):
        return gate[c] if gpu else T.Cast("float32", x[b, conv_dim + h * v_dim + c])

    @T.macro
    def head_norm(o_ws, x, gate, nw, out, vals, part, inv, b, h, active):
        for tx in lanes():
            with T.sblock("head_values"):
                T.reads()
                T.writes()
                reg = T.sblock_alloc_buffer((1,), "float32", scope="local")
                for e in T.unroll((norm_lanes + nt - 1) // nt):
                    c: T.let[T.int32] = e * nt + tx
                    if c < norm_lanes:
                        vals[c] = T.float32(0)
                        if active:
                            if c < v_dim:
                                if gpu:  # other blocks wrote it: from L2, not a stale L1 line
                                    T.ptx.ld.relaxed.gpu.global_.f32(
                                        reg[0], T.address_of(o_ws[b, h, c])
                                    )
                                else:
                                    reg[0] = o_ws[b, h, c]
                                vals[c] = rounded(reg[0], dtype)
        norms(vals, part, inv)
        for tx in lanes():
            with T.sblock("head_gate"):
                T.reads()
                T.writes()
                for e in T.unroll((v_dim + nt - 1) // nt):
                    c: T.let[T.int32] = e * nt + tx
                    if active:
                        if c < v_dim:
                            out[b, h * v_dim + c] = norm_gate(
                                vals[c], inv[0], nw[c], gate_input(x, gate, b, h, c), dtype
                            )

    return head_norm
