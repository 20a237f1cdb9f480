"""The gated full-attention layer's kernels around attention, each reading qkv_proj's output
in place.

qkv_proj writes one row a token: [q_0 | gate_0 | q_1 | gate_1 | ... | k | v] (Qwen3.5's q_proj
interleaves each head's query and output gate). Relax made ~12 kernels of what sits around the
attention kernels (splits, two RMSNorms, cos, sin, the two rotations, the K/V append, the gate);
here it is one kernel and a formula:

- `attention_input`: q and k RMSNorm (fp32 inside, rounded to the model dtype as the norm
  kernel's output was), RoPE on the first `rotary_dim` dims (neox halves, cos/sin in fp32 from
  positions x inv_freq, rounded once at the store), q written for the attention kernels, k and
  v written straight into their pages (what kv_cache.append_kv did).
- `gate_product`: round(o * round(sigmoid(gate))), o_proj's input, which both attention
  kernels apply where they store o (the gate beside its query: `gate_column`).

Written once as a grid of blocks, each a set of lanes (a warp a head, every 32nd channel a
lane) with phases that meet in shared memory; the CPU runs the blocks in parallel and the lanes
one after another.
"""

from __future__ import annotations

import numpy as np
from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .gdn_prep import rounded
from .kv_cache import PAGE_SIZE, seq_of_token
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

# the input kernel's name keeps "attn_append_kv": it is the layer's K/V append now
INPUT_NAME = "attn_append_kv_qk_norm_rope"
# a token's heads a block at most (a warp each)
HEADS_A_BLOCK = 16
# steps of at most this many tokens (decode, decode_wide) spread a head over head_dim lanes, a
# block a head: a decode step is latency-bound, and a warp a head (8 values a lane) took 36.0
# us a 16-row step against 24.8 for a block a head (profile_step_s22.json), and a warp a block
# 40.0 (profile_step_s23.json)
FEW_TOKENS = 64


def inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """RoPE's inverse frequencies [rotary_dim // 2], computed in fp32 as HF does."""
    exps = np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim
    return (1.0 / (theta**exps)).astype(np.float32)


def attention_input(
    heads: int,
    kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    eps: float,
    dtype: str,
    target: Target,
    few_tokens: int = FEW_TOKENS,
) -> PrimFunc:
    """(proj [n_tok, (2 heads + 2 kv_heads) head_dim], q_norm weight [d], k_norm weight [d],
    inv_freq [rotary_dim // 2], indptr, slots, positions, page_table, k_pool, v_pool, layer)
    -> k_pool, v_pool (in place; kv_cache's layout) and q [n_tok, heads, d].

    A warp owns one head of one token: a q head, or a kv head whose warp writes both its k
    (normed, rotated) and its v (copied) into the token's page. A block holds up to
    HEADS_A_BLOCK of a token's heads, so the token's page lookup is made once for them all. Two
    phases: each lane loads every 32nd value of its head and sums their squares; after the one
    barrier, each lane normalises its values and their rotation partners (read raw from shared
    memory and normalised by the same formula) and stores them. A lane's partial sum of squares
    and the order of the sum over lanes are the 32 partials of the block-a-head form this
    replaced, so outputs are unchanged bit for bit. Each phase
    issues all of a lane's global loads before it uses one: a decode step's few blocks wait on
    them, where a 1,024-token prefill's many blocks hide each other's.

    A step of at most `few_tokens` tokens launches a second kernel of the same body, chosen on
    the host by n_tok: a block a head, its values over head_dim / 32 warps (a value a lane), the
    lanes' squares added by warp in the order above, so both kernels give the same bits. A
    decode step's few heads are latency-bound: its lanes then each carry one value's chain.
    """
    d, half = head_dim, rotary_dim // 2
    if rotary_dim % 2 or not 0 < rotary_dim <= d:
        raise ValueError(f"rotary_dim {rotary_dim} for head_dim {d}")
    width = (2 * heads + 2 * kv_heads) * d
    k_off, v_off = 2 * heads * d, (2 * heads + kv_heads) * d
    heads_a_tok = heads + kv_heads
    per = -(-d // 32)  # values a lane: dims lane, lane + 32, ...
    tj = PAGE_SIZE
    gpu = target.kind.name == "cuda"
    shared = "shared" if gpu else "global"
    # v staged in the activation dtype on the GPU, in float32 on the CPU (TVM's CPU bf16
    # legalisation rejects local bf16 buffers)
    stage = dtype if gpu else "float32"

    def partner(dim):
        # a dim's partner in the rotation (neox halves); past rotary_dim, any in-bounds dim
        return T.if_then_else(dim < half, T.min(dim + half, d - 1), T.max(dim - half, 0))

    def rotated(dim, own, other, pos, freq):
        # (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
        ang = T.Cast("float32", pos) * freq[dim % half]
        return own * T.cos(ang) + T.if_then_else(dim < half, -other, other) * T.sin(ang)

    def blocks(most: int, spread: bool):
        """The macro of one kernel: up to `most` of a token's heads a block, a head's values
        over one warp (every 32nd value a lane), or with `spread` over `per` warps (a value a
        lane, whose 32-lane partial sums one warp then adds up in the same order)."""
        groups = -(-heads_a_tok // most)  # blocks a token, as even as they come
        hpb = -(-heads_a_tok // groups)
        hl = 32 * (per if spread else 1)  # lanes a head
        lpv = 1 if spread else per  # values a lane: dims lane, lane + hl, ...
        nt = hl * hpb
        n_sums = hpb * 32 if spread else 1
        grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

        @T.macro
        def launch(x, qw, kw, freq, indptr, slots, positions, table, kp, vp, layer, q, n_tok,
                   n_ptr):  # fmt: skip
            for blk in grid(n_tok * groups):
                with T.sblock("heads"):
                    T.reads()
                    T.writes()
                    vals = T.sblock_alloc_buffer((hpb * lpv * hl,), "float32", scope=shared)
                    part = T.sblock_alloc_buffer((nt,), "float32", scope=shared)
                    # a head's 32 partial sums of squares (spread: over its warps)
                    sums = T.sblock_alloc_buffer((n_sums,), "float32", scope=shared)
                    lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                    T.evaluate(release_dependents(gpu))
                    tok: T.let[T.int32] = blk // groups
                    hd0: T.let[T.int32] = blk % groups * hpb
                    seq_of_token(indptr, n_ptr - 1, tok, lo, hi)
                    pos: T.let[T.int32] = positions[tok]
                    page: T.let[T.int64] = T.Cast("int64", table[slots[lo[0]], pos // tj])
                    lay: T.let[T.int64] = T.Cast("int64", layer)
                    for tx in lanes():
                        with T.sblock("load"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            xs = T.sblock_alloc_buffer((lpv,), "float32", scope="local")
                            vs = T.sblock_alloc_buffer((lpv,), stage, scope="local")
                            hd: T.let[T.int32] = hd0 + tx // hl
                            kh: T.let[T.int32] = hd - heads
                            c0: T.let[T.int32] = T.if_then_else(
                                kh >= 0, k_off + kh * d, hd * 2 * d
                            )
                            for e in T.unroll(lpv):  # every load in flight before any use
                                dim: T.let[T.int32] = e * hl + tx % hl
                                xs[e] = T.float32(0)
                                if hd < heads_a_tok and dim < d:
                                    xs[e] = T.Cast("float32", x[tok, c0 + dim])
                                    if kh >= 0:
                                        vs[e] = T.Cast(stage, x[tok, v_off + kh * d + dim])
                            acc[0] = T.float32(0)
                            for e in T.unroll(lpv):
                                dim: T.let[T.int32] = e * hl + tx % hl
                                vals[tx // hl * lpv * hl + dim] = xs[e]
                                acc[0] = acc[0] + xs[e] * xs[e]
                                if hd < heads_a_tok and dim < d and kh >= 0:
                                    vp[lay, page, kh, pos % tj, dim] = T.Cast(dtype, vs[e])
                            part[tx] = acc[0]
                    if gpu:  # explicit: the planner places none under the host's kernel choice
                        T.tvm_storage_sync("shared")
                    if spread:  # lane l of a head's first warp: its dims l, l + 32, ... in turn
                        for tx in lanes():
                            with T.sblock("partials"):
                                T.reads()
                                T.writes()
                                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                if tx % hl < 32:
                                    acc[0] = T.float32(0)
                                    for w in T.unroll(hl // 32):
                                        acc[0] = acc[0] + part[tx // hl * hl + w * 32 + tx % hl]
                                    sums[tx // hl * 32 + tx % hl] = acc[0]
                        if gpu:
                            T.tvm_storage_sync("shared")
                    summed = T.meta_var(sums if spread else part)
                    for tx in lanes():
                        with T.sblock("norm_rope"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            ws = T.sblock_alloc_buffer((2 * lpv,), "float32", scope="local")
                            hd: T.let[T.int32] = hd0 + tx // hl
                            kh: T.let[T.int32] = hd - heads
                            base: T.let[T.int32] = tx // hl * lpv * hl
                            for e in T.unroll(lpv):  # the norm weights of a value and its partner
                                dim: T.let[T.int32] = T.min(e * hl + tx % hl, d - 1)
                                ws[e] = T.if_then_else(kh >= 0, kw[dim], qw[dim])
                                ws[lpv + e] = T.if_then_else(
                                    kh >= 0, kw[partner(dim)], qw[partner(dim)]
                                )
                            acc[0] = T.float32(0)
                            for p in T.unroll(32):
                                acc[0] = acc[0] + summed[tx // hl * 32 + p]
                            inv: T.let[T.float32] = T.rsqrt(acc[0] / T.float32(d) + T.float32(eps))
                            for e in T.unroll(lpv):
                                dim: T.let[T.int32] = e * hl + tx % hl
                                if hd < heads_a_tok and dim < d:
                                    # rounded to the model dtype, as the norm kernel's output was
                                    own: T.let[T.float32] = rounded(
                                        vals[base + dim] * inv * ws[e], dtype
                                    )
                                    other: T.let[T.float32] = rounded(
                                        vals[base + partner(dim)] * inv * ws[lpv + e], dtype
                                    )
                                    rot: T.let[T.float32] = T.if_then_else(
                                        dim < rotary_dim, rotated(dim, own, other, pos, freq), own
                                    )
                                    if kh >= 0:
                                        kp[lay, page, kh, pos % tj, dim] = T.Cast(dtype, rot)
                                    else:
                                        q[tok, hd, dim] = T.Cast(dtype, rot)

        return launch

    few, many = blocks(1, spread=True), blocks(HEADS_A_BLOCK, spread=False)

    @T.prim_func(s_tir=True)
    def attn_input_fn(
        x_h: T.handle,
        qw_h: T.handle,
        kw_h: T.handle,
        freq_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pos_h: T.handle,
        table_h: T.handle,
        kp_h: T.handle,
        vp_h: T.handle,
        layer: T.int32,
        q_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr, n_seq = T.int32(), T.int32(), T.int32()
        n_slots, width_pt = T.int32(), T.int32()
        n_layers, n_pages = T.int64(), T.int64()
        x = T.match_buffer(x_h, (n_tok, width), dtype)
        qw = T.match_buffer(qw_h, (d,), "float32")
        kw = T.match_buffer(kw_h, (d,), "float32")
        freq = T.match_buffer(freq_h, (half,), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        positions = T.match_buffer(pos_h, (n_tok,), "int32")
        table = T.match_buffer(table_h, (n_slots, width_pt), "int32")
        kp = T.match_buffer(kp_h, (n_layers, n_pages, kv_heads, tj, d), dtype)
        vp = T.match_buffer(vp_h, (n_layers, n_pages, kv_heads, tj, d), dtype)
        q = T.match_buffer(q_h, (n_tok, heads, d), dtype)
        if n_tok <= few_tokens:
            few(x, qw, kw, freq, indptr, slots, positions, table, kp, vp, layer, q, n_tok, n_ptr)
        else:
            many(x, qw, kw, freq, indptr, slots, positions, table, kp, vp, layer, q, n_tok, n_ptr)

    return attn_input_fn.with_attr("global_symbol", INPUT_NAME)


def gate_product(o, g, dtype: str):
    """HF's gated attention output from o (fp32, already rounded to `dtype`) and its gate g
    (fp32): round(o * round(sigmoid(g)))."""
    return T.Cast(dtype, o * rounded(T.float32(1) / (T.float32(1) + T.exp(-g)), dtype))


def gate_column(h, head_dim: int):
    """Where head h's output gate starts in qkv_proj's row ([q_0 gate_0 q_1 gate_1 ... | k |
    v]): beside its query."""
    return h * 2 * head_dim + head_dim
