"""Gated DeltaNet kernels: causal depthwise conv1d with state, and the gated delta rule.

Both kernels are ragged: a batch is one token array with `indptr` marking where each
sequence starts, and `slots` naming each sequence's row in the state pools. The pools
hold every live sequence's state for every GDN layer and are updated in place:

- conv pool      [slots, gdn_layers, conv_dim, kernel - 1]   (activation dtype)
- recurrent pool [slots, gdn_layers, v_heads, v_dim, k_dim]  (float32)

The recurrent state is stored transposed relative to HF ([k_dim, v_dim] there) so that
each value column's state is contiguous: every (sequence, head, value column) is an
independent recurrence over time, which is what the kernels parallelise over.
"""

from __future__ import annotations

from typing import NamedTuple

from tvm import s_tir
from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .kv_cache import seq_of_token
from .loops import block_loop, thread_loop
from .pdl import release_dependents, wait_for_producers

GPU_THREADS = 128


def _for_target(func: PrimFunc, blocks: list[str], target: Target, vec: int = 1) -> PrimFunc:
    """Each kernel is written as (row) x (independent lane) loops around one block: the CPU
    runs lanes in parallel; the GPU gives rows the grid's y axis and lanes threads, `vec`
    consecutive lanes a thread as one vector access."""
    sch = s_tir.Schedule(func)
    for block in blocks:
        outer, inner = sch.get_loops(sch.get_sblock(block))[:2]
        if target.kind.name == "cuda":
            if vec > 1:
                inner, v = sch.split(inner, [None, vec])
                sch.vectorize(v)
            bx, tx = sch.split(inner, [None, GPU_THREADS])
            sch.bind(outer, "blockIdx.y")
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
        else:
            sch.parallel(inner)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def conv1d_with_state(conv_dim: int, kernel: int, dtype: str, target: Target) -> PrimFunc:
    """out[t] = silu(sum_k w[k] * x[t - kernel + 1 + k]), reading the window before a
    sequence's first token from its conv state and leaving its last kernel - 1 inputs there.
    The model now runs gdn_prep.gdn_input, whose conv must equal this kernel's output.

    Every (token, channel) is independent, so a prefill chunk's tokens run in parallel (a
    thread each, its sequence found by binary search); a second kernel then moves each
    sequence's last inputs into its state, after every window has read the old one."""
    hist = kernel - 1

    @T.prim_func(s_tir=True)
    def gdn_conv1d(
        x_h: T.handle,
        w_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        out_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n_tok, n_ptr, batch = T.int32(), T.int32(), T.int32()
        n_slots, n_layers = T.int32(), T.int32()
        x = T.match_buffer(x_h, (n_tok, conv_dim), dtype)
        w = T.match_buffer(w_h, (conv_dim, kernel), dtype)
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        pool = T.match_buffer(pool_h, (n_slots, n_layers, conv_dim, hist), dtype)
        out = T.match_buffer(out_h, (n_tok, conv_dim), dtype)
        for i in T.serial(n_tok):
            for c in T.serial(conv_dim):
                with T.sblock("conv"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                    seq_of_token(indptr, batch, i, lo, hi)
                    t: T.let[T.int32] = i - indptr[lo[0]]  # the token's place in its sequence
                    slot: T.let[T.int32] = slots[lo[0]]
                    acc[0] = T.float32(0)
                    for k in T.unroll(kernel):
                        # j: the input's position relative to the sequence's first token
                        j: T.let[T.int32] = t - hist + k
                        acc[0] = acc[0] + T.Cast("float32", w[c, k]) * T.if_then_else(
                            j >= 0,
                            T.Cast("float32", x[T.max(i - hist + k, 0), c]),
                            T.Cast("float32", pool[slot, layer, c, T.min(hist + j, hist - 1)]),
                        )
                    out[i, c] = T.Cast(dtype, acc[0] / (T.float32(1) + T.exp(-acc[0])))
        for b in T.serial(batch):
            for c in T.serial(conv_dim):
                with T.sblock("conv_state"):
                    T.reads()
                    T.writes()
                    start: T.let[T.int32] = indptr[b]
                    length: T.let[T.int32] = indptr[b + 1] - start
                    slot: T.let[T.int32] = slots[b]
                    # Ascending i reads old state at i + length >= i before overwriting it.
                    for i in T.serial(hist):
                        j: T.let[T.int32] = length - hist + i
                        pool[slot, layer, c, i] = T.if_then_else(
                            j >= 0,
                            x[start + T.max(j, 0), c],
                            pool[slot, layer, c, T.min(hist + j, hist - 1)],
                        )

    return _for_target(gdn_conv1d, ["conv", "conv_state"], target)


# recurrent kernel: state rows (value columns) a block, and threads sharing a row, each over
# k_dim / PARTS of it. 16 x 8 by the H200 sweep (gdn_recurrent_sweep.json): one sequence
# 4.5 -> 3.4 us a layer against 32 x 4, 16 and 64 sequences the same
ROWS = 16
PARTS = 8


class RuleLayout(NamedTuple):
    """How a block of the recurrent kernels holds its state rows (see gated_delta_rule)."""

    rows: int  # value columns (state rows) a block
    parts: int  # threads a row
    k_dim: int

    @staticmethod
    def of(k_dim: int, v_dim: int, rows: int = ROWS, parts: int = PARTS) -> RuleLayout:
        rows = next(r for r in (rows, 16, 8, 4, 2, 1) if v_dim % r == 0)
        return RuleLayout(rows, parts if k_dim % parts == 0 else 1, k_dim)

    @property
    def threads(self) -> int:
        return self.rows * self.parts

    @property
    def v_at(self) -> int:
        """Where a token's staged inputs, [k | q | v of the block's rows | g | beta], hold v."""
        return 2 * self.k_dim

    @property
    def g_at(self) -> int:
        return self.v_at + self.rows

    @property
    def staged(self) -> int:
        return self.g_at + 2  # g, then beta


def stored(v, dtype) -> object:
    """fp32 `v` as a buffer of `dtype` holds it (the core output may be kept in the
    activation dtype: core_out_dtype)."""
    return v if str(dtype) == "float32" else T.Cast(str(dtype), v)


def rule_phases(lay: RuleLayout, gpu: bool):
    """The recurrent kernels' shared phases, as macros over a block's buffers: copy the state
    rows of (slot, head) to shared memory and back, and one token's update from its staged
    inputs (RuleLayout.staged) into `out[tok, h, col0 + row]`."""
    rows, parts, k_dim = lay
    nt = lay.threads
    span = k_dim // parts  # dims of a row a thread updates
    stride = k_dim + 1  # padded shared row
    vec = 4 if k_dim % 4 == 0 else 1
    per_row = k_dim // vec
    copies = -(-rows * per_row // nt)  # vec-wide copies a thread, to and from shared memory
    scale = float(k_dim) ** -0.5
    vs, gi, bi = lay.v_at, lay.g_at, lay.g_at + 1  # staged v, g, beta
    lanes = thread_loop(nt, gpu)

    @T.macro
    def load_state(pool, slot, layer, h, col0, st, active):
        # `active` (True, or a block-uniform condition): whether the block's state is its own
        # to read, update and write (gdn_decode's ragged form); tested inside the thread loop
        for tx in lanes():
            with T.sblock("load"):
                T.reads()
                T.writes()
                reg = T.sblock_alloc_buffer((vec,), "float32", scope="local")
                if active:
                    for e in T.unroll(copies):
                        x: T.let[T.int32] = T.min(e * nt + tx, rows * per_row - 1)
                        for i in T.vectorized(vec):
                            reg[i] = pool[slot, layer, h, col0 + x // per_row,
                                          x % per_row * vec + i]  # fmt: skip
                        for i in T.unroll(vec):
                            st[x // per_row * stride + x % per_row * vec + i] = reg[i]

    @T.macro
    def store_state(pool, slot, layer, h, col0, st, active):
        for tx in lanes():
            with T.sblock("store"):
                T.reads()
                T.writes()
                reg = T.sblock_alloc_buffer((vec,), "float32", scope="local")
                for e in T.unroll(copies):
                    x: T.let[T.int32] = e * nt + tx
                    if active and x < rows * per_row:
                        for i in T.unroll(vec):
                            reg[i] = st[x // per_row * stride + x % per_row * vec + i]
                        for i in T.vectorized(vec):
                            pool[slot, layer, h, col0 + x // per_row, x % per_row * vec + i] = (
                                reg[i]
                            )

    @T.macro
    def token_update(st, kq, red, out, tok, h, col0, active):
        # Each phase reads a thread's state words into registers before it writes any back:
        # a word read and written in turn would get a barrier on each side (ThreadSync cannot
        # tell that no other thread touches it), two a state element.
        # decay the rows and take this thread's share of S k
        for tx in lanes():
            with T.sblock("decay"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                sv = T.sblock_alloc_buffer((span,), "float32", scope="local")
                r: T.let[T.int32] = tx % rows
                d0: T.let[T.int32] = tx // rows * span
                decay: T.let[T.float32] = T.exp(kq[gi])
                for j in T.unroll(span):
                    sv[j] = st[r * stride + d0 + j] * decay
                acc[0] = T.float32(0)
                for j in T.unroll(span):
                    st[r * stride + d0 + j] = sv[j]
                    acc[0] = acc[0] + sv[j] * kq[d0 + j]
                red[tx] = acc[0]
        # the delta update and this thread's share of S q
        for tx in lanes():
            with T.sblock("update"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                sv = T.sblock_alloc_buffer((span,), "float32", scope="local")
                r: T.let[T.int32] = tx % rows
                d0: T.let[T.int32] = tx // rows * span
                acc[0] = T.float32(0)
                for p in T.unroll(parts):
                    acc[0] = acc[0] + red[p * rows + r]
                delta: T.let[T.float32] = (kq[vs + r] - acc[0]) * kq[bi]
                for j in T.unroll(span):
                    sv[j] = st[r * stride + d0 + j] + kq[d0 + j] * delta
                acc[0] = T.float32(0)
                for j in T.unroll(span):
                    st[r * stride + d0 + j] = sv[j]
                    acc[0] = acc[0] + sv[j] * kq[k_dim + d0 + j]
                red[nt + tx] = acc[0]
        for tx in lanes():
            with T.sblock("emit"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                if active and tx < rows:
                    acc[0] = T.float32(0)
                    for p in T.unroll(parts):
                        acc[0] = acc[0] + red[nt + p * rows + tx]
                    out[tok, h, col0 + tx] = stored(acc[0] * T.float32(scale), out.dtype)

    return load_state, token_update, store_state


def gated_delta_rule(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    target: Target,
    rows: int = ROWS,
    parts: int = PARTS,
) -> PrimFunc:
    """The gated delta rule over each sequence, starting from and updating its state:
    S <- S * exp(g); S <- S + beta * k (v - S k)ᵀ; o = S q / sqrt(k_dim).

    A block owns ROWS value columns of one (sequence, head): their state rows are copied to
    shared memory with whole-row coalesced loads (rows padded by one float, so the threads
    walking the rows below hit 32 different banks), updated there token by token by PARTS
    threads a row (partial dot products summed through shared memory), and written back the
    same way. One sequence at the 4B shapes is 256 blocks, enough to stream its 2 MB of state
    a layer at bandwidth. The CPU runs the same loop nest, its lanes one after another.
    Decode runs gdn_decode.decode_delta_rule, these phases behind its own input prologue;
    this ragged kernel is the reference the chunked one is tested against."""
    group = v_heads // k_heads
    gpu = target.kind.name == "cuda"
    lay = RuleLayout.of(k_dim, v_dim, rows, parts)
    rows, nt, staged = lay.rows, lay.threads, lay.staged
    v_at, g_at = lay.v_at, lay.g_at
    tiles = v_dim // rows
    shared = "shared" if gpu else "global"
    load_state, token_update, store_state = rule_phases(lay, gpu)
    grid, lanes = block_loop(gpu), thread_loop(nt, gpu)

    @T.prim_func(s_tir=True)
    def gdn_delta_rule(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
        indptr_h: T.handle,
        slots_h: T.handle,
        pool_h: T.handle,
        layer: T.int32,
        out_h: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_ptr, batch = T.int32(), T.int32(), T.int32()
        n_slots, n_layers = T.int32(), T.int32()
        q = T.match_buffer(q_h, (n_tok, k_heads, k_dim), "float32")
        k = T.match_buffer(k_h, (n_tok, k_heads, k_dim), "float32")
        v = T.match_buffer(v_h, (n_tok, v_heads, v_dim), "float32")
        g = T.match_buffer(g_h, (n_tok, v_heads), "float32")
        beta = T.match_buffer(beta_h, (n_tok, v_heads), "float32")
        indptr = T.match_buffer(indptr_h, (n_ptr,), "int32")
        slots = T.match_buffer(slots_h, (batch,), "int32")
        pool = T.match_buffer(pool_h, (n_slots, n_layers, v_heads, v_dim, k_dim), "float32")
        out = T.match_buffer(out_h, (n_tok, v_heads, v_dim), "float32")
        for blk in grid(batch * v_heads * tiles):
            with T.sblock("delta_rule"):
                T.reads()
                T.writes()
                st = T.sblock_alloc_buffer((rows * (k_dim + 1),), "float32", scope=shared)
                kq = T.sblock_alloc_buffer((staged,), "float32", scope=shared)
                red = T.sblock_alloc_buffer((2 * nt,), "float32", scope=shared)
                T.evaluate(wait_for_producers(gpu))  # first: schedules/pdl.py
                T.evaluate(release_dependents(gpu))
                b: T.let[T.int32] = blk // (v_heads * tiles)
                h: T.let[T.int32] = blk // tiles % v_heads
                col0: T.let[T.int32] = blk % tiles * rows
                kh: T.let[T.int32] = h // group
                start: T.let[T.int32] = indptr[b]
                slot: T.let[T.int32] = slots[b]
                load_state(pool, slot, layer, h, col0, st, True)
                for t in T.serial(indptr[b + 1] - start):
                    for tx in lanes():
                        with T.sblock("stage"):
                            T.reads()
                            T.writes()
                            for e in T.serial((staged + nt - 1) // nt):
                                x: T.let[T.int32] = e * nt + tx
                                if x < k_dim:
                                    kq[x] = k[start + t, kh, x]
                                elif x < v_at:
                                    kq[x] = q[start + t, kh, x - k_dim]
                                elif x < g_at:
                                    kq[x] = v[start + t, h, col0 + x - v_at]
                                elif x == g_at:
                                    kq[x] = g[start + t, h]
                                elif x < staged:
                                    kq[x] = beta[start + t, h]
                    token_update(st, kq, red, out, start + t, h, col0, True)
                store_state(pool, slot, layer, h, col0, st, True)

    return gdn_delta_rule


def reset_slots(numel: int, dtype: str, name: str, target: Target) -> PrimFunc:
    """Zero the given slots of a pool viewed as [slots, numel]."""

    @T.prim_func(s_tir=True)
    def gdn_reset_slots(pool_h: T.handle, slots_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_slots, count = T.int32(), T.int32()
        pool = T.match_buffer(pool_h, (n_slots, numel), dtype)
        slots = T.match_buffer(slots_h, (count,), "int32")
        for i in T.serial(count):
            for e in T.serial(numel):
                with T.sblock("reset"):
                    T.reads()
                    T.writes()
                    pool[slots[i], e] = T.Cast(dtype, 0)

    # 16-byte stores on the GPU: a 4B slot's recurrent state is 50 MB, zeroed for each prompt
    vec = 16 // (2 if dtype == "bfloat16" else 4)
    vec = vec if numel % (vec * GPU_THREADS) == 0 else 1
    return _for_target(gdn_reset_slots, ["reset"], target, vec).with_attr("global_symbol", name)
