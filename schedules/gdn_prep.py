"""Gated DeltaNet's kernels around the delta rule, each reading the in_proj output directly.

in_proj writes one row a token: [q | k | v | z | b | a], the first three (conv_dim channels)
going through the causal conv1d. Relax made ~14 kernels of what is left of a layer (splits,
casts, conv and its state move, two l2 norms, the gates, the gated norm); here it is two:

- `gdn_input`: conv1d with the per-slot conv state (read only), SiLU, rounding
  to the model dtype, then q and k l2-normalised and v in fp32, and the gates
  g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b): what the delta rule takes.
  (bf16 prefill on CUDA does this inside gdn_chunk_prep, and decode inside gdn_decode, with
  the same arithmetic: `conv_silu`, `log_decay`, `beta_gate`, `l2_parts`.)
- `gated_norm`: the delta rule's output rounded to the model dtype, RMSNorm over each head,
  rounded again, times silu(z): out_proj's input. It also moves each sequence's last conv
  inputs into its conv state, once every kernel that reads the old state is done.

Both are written once as a grid of blocks, each a set of lanes (a channel a lane), with phases
that meet in shared memory; the CPU runs the blocks in parallel and the lanes one after another.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .kv_cache import first_tile, seq_of_tile
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

TILE = 16  # gdn_input: tokens of one sequence a block (>= the conv history)
HEADS = 8  # gated_norm: (token, head) rows a block, at most


def _lanes(width: int) -> int:
    return -(-width // 32) * 32  # whole warps


def l2_parts(k_dim: int, v_dim: int) -> int:
    """Partial sums of squares a q or k row in gdn_input's l2 norm (every parts-th value from
    value p on, then the partials in order): gdn_decode sums in the same order, so a decode
    row's q and k equal those of the same token in a prefill chunk."""
    return _lanes(max(k_dim, v_dim, TILE)) // TILE


def _row_norms(rows: int, parts: int, nt: int, lanes, finish):
    """A macro (vals, part, inv): inv[r] = finish(sum of squares of vals[r * nt : r * nt +
    nt]) for r < rows, two-level through shared memory. Lane (row, share) first sums every
    parts-th value of its row (so lanes hit distinct banks) into part; then a lane a row adds
    its row's partial sums."""
    per_part = nt // parts

    @T.macro
    def norms(vals, part, inv):
        for tx in lanes():
            with T.sblock("squares"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                if tx < rows * parts:
                    acc[0] = T.float32(0)
                    for e in T.unroll(per_part):
                        sv: T.let[T.float32] = vals[tx // parts * nt + e * parts + tx % parts]
                        acc[0] = acc[0] + sv * sv
                    part[tx] = acc[0]
        for tx in lanes():
            with T.sblock("norms"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                if tx < rows:
                    acc[0] = T.float32(0)
                    for p in T.unroll(parts):
                        acc[0] = acc[0] + part[tx * parts + p]
                    inv[tx] = finish(acc[0])

    return norms


def rounded(v, dtype: str):
    """fp32 v rounded (to nearest even) to `dtype` and back. By hand for bf16: TVM's CPU bf16
    legalisation drops a cast to bf16 and back, and a bf16 local buffer is kept in fp32."""
    if dtype == "float32":
        return v
    assert dtype == "bfloat16", dtype
    bits = T.reinterpret("uint32", v)
    odd = T.shift_right(bits, T.uint32(16)) & T.uint32(1)
    return T.reinterpret("float32", (bits + T.uint32(0x7FFF) + odd) & T.uint32(0xFFFF0000))


def head_norm_layout(v_heads: int, v_dim: int) -> tuple[int, int, int]:
    """gated_norm's (heads a block, lanes a head, partial sums a head): the order its RMSNorm
    sums a head's squares in, which gdn_decode's fused norm follows."""
    rows = next(r for r in (HEADS, 4, 2, 1) if v_heads % r == 0)
    nt = _lanes(max(v_dim, rows))
    return rows, nt, min(nt // rows, 16)


def head_norms(rows: int, parts: int, nt: int, v_dim: int, eps: float, lanes):
    """The gated norm's 1/rms of `rows` heads: a macro (vals, part, inv) as _row_norms'."""
    return _row_norms(
        rows, parts, nt, lanes, lambda sq: T.rsqrt(sq / T.float32(v_dim) + T.float32(eps))
    )


def norm_gate(o, inv, weight, z, dtype: str):
    """One output of the gated RMSNorm: round(o · 1/rms · weight) · silu(z), in `dtype`."""
    silu = z * (T.float32(1) / (T.float32(1) + T.exp(-z)))
    return T.Cast(dtype, rounded(o * inv * weight, dtype) * silu)


def beta_gate(b):
    """beta = sigmoid(b), b read from in_proj's row."""
    return T.float32(1) / (T.float32(1) + T.exp(-b))


def log_decay(a, a_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias), a read from in_proj's row."""
    s = a + dt_bias
    return -T.exp(a_log) * T.if_then_else(s > T.float32(20), s, T.log(T.float32(1) + T.exp(s)))


def conv_silu(wt, win, kernel: int, dtype: str, at=0):
    """One channel's causal conv1d from local buffers of its fp32 weights and window (oldest
    input first, from win[at]), summed in that order in every kernel that uses it, SiLU'd and
    rounded to the model dtype as the conv's output was."""
    acc = wt[0] * win[at]
    for i in range(1, kernel):
        acc = acc + wt[i] * win[at + i]
    return rounded(acc / (T.float32(1) + T.exp(-acc)), dtype)


def gdn_input(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    kernel: int,
    dtype: str,
    target: Target,
) -> PrimFunc:
    """(proj [n_tok, conv_dim + value_dim + 2 hv], conv weight [conv_dim, kernel], A_log [hv],
    dt_bias [hv], indptr, slots, conv pool (read only: gated_norm moves it on), layer) -> q and k
    [n_tok, hk, dk], v [n_tok, hv, dv], g and beta [n_tok, hv], all fp32.

    A block owns up to TILE consecutive tokens of one sequence and one head of q, k or v; a
    lane owns a channel and slides the conv window over the tile's tokens in registers. The
    tiles of sequence b are numbered from indptr[b] // TILE + b on, which leaves room for every
    sequence's ceil(length / TILE) tiles (and one for an empty sequence) in n_tok // TILE +
    batch blocks a head. Only a sequence's first tile reads its conv state (TILE >= history).
    The l2 norm of a tile's tokens is one two-level sum through shared memory."""
    hist = kernel - 1
    assert hist <= TILE, "a sequence's first tile must hold every token that reads the state"
    key_dim, value_dim = k_heads * k_dim, v_heads * v_dim
    conv_dim = 2 * key_dim + value_dim
    width = conv_dim + value_dim + 2 * v_heads
    heads = 2 * k_heads + v_heads  # q heads, k heads, v heads
    gpu = target.kind.name == "cuda"
    nt = _lanes(max(k_dim, v_dim, TILE))
    parts = nt // TILE  # partial sums a token, TILE squares each
    shared = "shared" if gpu else "global"

    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)
    norms = _row_norms(
        TILE, parts, nt, lanes, lambda sq: T.float32(1) / T.sqrt(sq + T.float32(1e-6))
    )

    @T.prim_func(s_tir=True)
    def gdn_input_fn(
        x_h: T.handle,
        w_h: T.handle,
        a_log_h: T.handle,
        dt_bias_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr, batch = T.int32(), T.int32(), T.int32()
        n_slots, n_layers = T.int32(), T.int32()
        x = T.match_buffer(x_h, (n_tok, width), dtype)
        w = T.match_buffer(w_h, (conv_dim, kernel), dtype)
        a_log = T.match_buffer(a_log_h, (v_heads,), "float32")
        dt_bias = T.match_buffer(dt_bias_h, (v_heads,), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        pool = T.match_buffer(pool_h, (n_slots, n_layers, conv_dim, hist), dtype)
        q = T.match_buffer(q_h, (n_tok, k_heads, k_dim), "float32")
        k = T.match_buffer(k_h, (n_tok, k_heads, k_dim), "float32")
        v = T.match_buffer(v_h, (n_tok, v_heads, v_dim), "float32")
        g = T.match_buffer(g_h, (n_tok, v_heads), "float32")
        beta = T.match_buffer(beta_h, (n_tok, v_heads), "float32")
        for blk in grid((n_tok // TILE + batch) * heads):
            with T.sblock("tile"):
                T.reads()
                T.writes()
                vals = T.sblock_alloc_buffer((TILE * nt,), "float32", scope=shared)
                part = T.sblock_alloc_buffer((TILE * parts,), "float32", scope=shared)
                inv = T.sblock_alloc_buffer((TILE,), "float32", scope=shared)
                lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                tile: T.let[T.int32] = blk // heads
                hd: T.let[T.int32] = blk % heads
                seq_of_tile(indptr, batch, tile, TILE, lo, hi)
                start: T.let[T.int32] = indptr[lo[0]]
                length: T.let[T.int32] = indptr[lo[0] + 1] - start
                # the tile's place in its sequence
                nth: T.let[T.int32] = tile - first_tile(indptr, lo[0], TILE)
                t0: T.let[T.int32] = nth * TILE
                count: T.let[T.int32] = T.max(T.min(length - t0, TILE), 0)
                slot: T.let[T.int32] = slots[lo[0]]
                is_v: T.let[T.bool] = hd >= 2 * k_heads
                c0: T.let[T.int32] = T.if_then_else(
                    is_v, 2 * key_dim + (hd - 2 * k_heads) * v_dim, hd * k_dim
                )
                live: T.let[T.int32] = T.if_then_else(is_v, v_dim, k_dim)
                for tx in lanes():
                    with T.sblock("conv"):
                        T.reads()
                        T.writes()
                        win = T.sblock_alloc_buffer((kernel,), "float32", scope="local")
                        wt = T.sblock_alloc_buffer((kernel,), "float32", scope="local")
                        if tx < live:
                            c: T.let[T.int32] = c0 + tx
                            for i in T.unroll(kernel):
                                wt[i] = T.Cast("float32", w[c, i])
                            # the window before the tile: earlier tokens, else the old state
                            for i in T.unroll(hist):
                                j: T.let[T.int32] = t0 - hist + i
                                win[i] = T.if_then_else(
                                    j >= 0,
                                    T.Cast("float32", x[T.min(start + T.max(j, 0), n_tok - 1), c]),
                                    T.Cast(
                                        "float32", pool[slot, layer, c, T.min(hist + j, hist - 1)]
                                    ),
                                )
                            # Tokens past the tile's last repeat it: no guard, so the loads of
                            # a full tile can all be in flight at once; those rows go unread.
                            for tt in T.unroll(TILE):
                                win[hist] = T.Cast(
                                    "float32",
                                    x[T.max(start + T.min(t0 + tt, length - 1), 0), c],
                                )
                                vals[tt * nt + tx] = conv_silu(wt, win, kernel, dtype)
                                for i in T.unroll(hist):
                                    win[i] = win[i + 1]
                        else:
                            for tt in T.unroll(TILE):
                                vals[tt * nt + tx] = T.float32(0)
                norms(vals, part, inv)
                for tx in lanes():
                    with T.sblock("emit"):
                        T.reads()
                        T.writes()
                        ab = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        if tx < live:
                            for tt in T.unroll(TILE):
                                if tt < count:
                                    if hd < k_heads:
                                        q[start + t0 + tt, hd, tx] = vals[tt * nt + tx] * inv[tt]
                                    elif hd < 2 * k_heads:
                                        k[start + t0 + tt, hd - k_heads, tx] = (
                                            vals[tt * nt + tx] * inv[tt]
                                        )
                                    else:
                                        v[start + t0 + tt, hd - 2 * k_heads, tx] = vals[
                                            tt * nt + tx
                                        ]
                        # a v head's block also makes its gates, a token a lane
                        if is_v and tx < count:
                            h: T.let[T.int32] = hd - 2 * k_heads
                            ab[0] = T.Cast("float32", x[start + t0 + tx, conv_dim + value_dim + h])
                            ab[1] = T.Cast(
                                "float32", x[start + t0 + tx, conv_dim + value_dim + v_heads + h]
                            )
                            beta[start + t0 + tx, h] = beta_gate(ab[0])
                            g[start + t0 + tx, h] = log_decay(ab[1], a_log[h], dt_bias[h])

    return gdn_input_fn.with_attr("global_symbol", "gdn_input")


def core_out(v, dtype: str):
    """The delta rule's output as HF's gated norm takes it: rounded to the activation dtype
    (already so where o is kept in it), as fp32."""
    return rounded(v, dtype) if str(v.ty) == "float32" else T.Cast("float32", v)


def gated_norm(
    v_heads: int,
    v_dim: int,
    conv_dim: int,
    kernel: int,
    eps: float,
    dtype: str,
    target: Target,
    o_dtype: str = "float32",
) -> PrimFunc:
    """(o [n_tok, hv, dv] of `o_dtype` (fp32, or `dtype`: gdn_chunked.core_out_dtype), proj
    [n_tok, width] (z at conv_dim + h * dv), weight [dv], indptr, slots, conv pool, layer) ->
    conv pool (in place), [n_tok, hv * dv]:
    round(round(rmsnorm(round(o)) * weight) * silu(z)), rounding to `dtype` where the Relax
    graph did.

    A block owns `rows` heads of one token (a lane a channel, each lane a channel of every
    head, so a lane has that many loads in flight); each head's sum of squares is two-level
    through shared memory like gdn_input's. Blocks past those move each sequence's last
    kernel - 1 conv inputs into its conv state, a lane a channel, every load before any store:
    the kernels before this one (gdn_input, gdn_decode) only read the state, from many blocks,
    so it moves here, after all of them."""
    hist = kernel - 1
    rows, nt, parts = head_norm_layout(v_heads, v_dim)
    gpu = target.kind.name == "cuda"
    groups = v_heads // rows
    shifts = -(-conv_dim // nt)  # conv-state blocks a sequence
    shared = "shared" if gpu else "global"

    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)
    norms = head_norms(rows, parts, nt, v_dim, eps, lanes)

    @T.prim_func(s_tir=True)
    def gated_norm_fn(
        o_h: T.handle,
        x_h: T.handle,
        w_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        out_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, width, n_ptr, batch = T.int32(), T.int32(), T.int32(), T.int32()
        n_slots, n_layers = T.int32(), T.int32()
        o = T.match_buffer(o_h, (n_tok, v_heads, v_dim), o_dtype)
        x = T.match_buffer(x_h, (n_tok, width), dtype)
        w = T.match_buffer(w_h, (v_dim,), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        pool = T.match_buffer(pool_h, (n_slots, n_layers, conv_dim, hist), dtype)
        out = T.match_buffer(out_h, (n_tok, v_heads * v_dim), dtype)
        for blk in grid(n_tok * groups + batch * shifts):
            with T.sblock("row"):
                T.reads()
                T.writes()
                vals = T.sblock_alloc_buffer((rows * nt,), "float32", scope=shared)
                # z is staged with o: its loads overlap o's instead of following the norm
                zs = T.sblock_alloc_buffer((rows * nt,), "float32", scope=shared)
                part = T.sblock_alloc_buffer((rows * parts,), "float32", scope=shared)
                inv = T.sblock_alloc_buffer((rows,), "float32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                tok: T.let[T.int32] = blk // groups
                h0: T.let[T.int32] = blk % groups * rows
                # a barrier may not fall inside a condition: each phase tests the block's role
                for tx in lanes():
                    with T.sblock("conv_state"):
                        T.reads()
                        T.writes()
                        win = T.sblock_alloc_buffer((hist,), dtype, scope="local")
                        b: T.let[T.int32] = (blk - n_tok * groups) // shifts
                        c: T.let[T.int32] = (blk - n_tok * groups) % shifts * nt + tx
                        if blk >= n_tok * groups and c < conv_dim:
                            start: T.let[T.int32] = indptr[b]
                            length: T.let[T.int32] = indptr[b + 1] - start
                            for i in T.unroll(hist):
                                j: T.let[T.int32] = length - hist + i
                                win[i] = T.if_then_else(
                                    j >= 0,
                                    x[T.min(start + T.max(j, 0), n_tok - 1), c],
                                    pool[slots[b], layer, c, T.min(hist + j, hist - 1)],
                                )
                            for i in T.unroll(hist):
                                pool[slots[b], layer, c, i] = win[i]
                for tx in lanes():
                    with T.sblock("load"):
                        T.reads()
                        T.writes()
                        for r in T.unroll(rows):
                            vals[r * nt + tx] = T.float32(0)
                            if blk < n_tok * groups and tx < v_dim:
                                vals[r * nt + tx] = core_out(o[tok, h0 + r, tx], dtype)
                                zs[r * nt + tx] = T.Cast(
                                    "float32", x[tok, conv_dim + (h0 + r) * v_dim + tx]
                                )
                norms(vals, part, inv)
                for tx in lanes():
                    with T.sblock("gate"):
                        T.reads()
                        T.writes()
                        if blk < n_tok * groups and tx < v_dim:
                            for r in T.unroll(rows):
                                out[tok, (h0 + r) * v_dim + tx] = norm_gate(
                                    vals[r * nt + tx], inv[r], w[tx], zs[r * nt + tx], dtype
                                )

    return gated_norm_fn.with_attr("global_symbol", "gdn_gated_norm")
