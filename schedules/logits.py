"""The logits projection: hidden × W[:selection]ᵀ with columns [decodable, selection) forced
to -inf in the same kernel.

Projecting onto `selection` (a multiple of 128) instead of the odd `decodable` width keeps
the weight rows aligned for vectorised loads; the pad rows are real trained embeddings, so
their columns are masked here, where nothing downstream can forget to.
"""

from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import Target
from tvm.tirx import PrimFunc

from .pdl import release_dependents, wait_for_producers
from .ptx import mma_bf16


def logits_projection(
    hidden: int,
    rows: int,
    decodable: int,
    selection: int,
    dtype: str,
    target: Target,
    mask_pad: bool = True,
) -> PrimFunc:
    """The logits kernel for `target`. `mask_pad=False` exists only so the test suite can
    prove its mask test fails on an unmasked build; the compiler never sets it otherwise."""
    if not 0 < decodable <= selection <= rows:
        raise ValueError(f"need 0 < decodable {decodable} <= selection {selection} <= rows {rows}")
    if target.kind.name != "cuda":
        build = _logits_cpu
    else:
        tensor_cores = dtype == "bfloat16" and hidden % 256 == 0
        build = _logits_gpu_mma if tensor_cores else _logits_gpu
    body = build(hidden, rows, decodable if mask_pad else selection, selection, dtype)

    @T.prim_func(s_tir=True)
    def logits(x_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch = T.int32()
        x = T.match_buffer(x_h, (batch, hidden), dtype)
        w = T.match_buffer(w_h, (rows, hidden), dtype)
        out = T.match_buffer(out_h, (batch, selection), "float32")
        body(x, w, out, batch)

    return logits


def _logits_cpu(hidden: int, rows: int, live: int, selection: int, dtype: str):
    """Columns run in parallel; each reads its weight row once for the whole batch."""
    neg_inf = T.float32("-inf")

    @T.macro
    def body(x, w, out, batch):
        for j in T.parallel(selection):
            for b in T.serial(batch):
                with T.sblock("logits"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((1,), "float32")
                    if j < live:
                        acc[0] = T.float32(0)
                        for d in T.serial(hidden):
                            acc[0] = acc[0] + T.Cast("float32", x[b, d]) * T.Cast(
                                "float32", w[j, d]
                            )
                        out[b, j] = acc[0]
                    else:
                        out[b, j] = neg_inf

    return body


def _logits_gpu(hidden: int, rows: int, live: int, selection: int, dtype: str):
    """A warp owns COLS adjacent columns; each lane streams its slice of their
    weight rows with 128-bit loads and reuses every hidden-vector load across those columns.
    Batches are taken BT rows at a time, so the weight slice is re-read from cache, not DRAM.
    Pad columns never load their row: they are written -inf directly."""
    vec = 16 // (2 if dtype in ("bfloat16", "float16") else 4)  # elements per 128-bit load
    if hidden % vec:
        raise ValueError(f"hidden size {hidden} must be a multiple of {vec}")
    lanes, cols, warps, bt = 32, 4, 4, 16
    k_iters = -(-hidden // (lanes * vec))
    n_blocks = -(-selection // (cols * warps))
    neg_inf = T.float32("-inf")

    @T.macro
    def body(x, w, out, batch):
        for bx in T.thread_binding(n_blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(lanes, thread="threadIdx.x"):
                    with T.sblock("logits"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((bt * cols,), "float32", scope="local")
                        w_loc = T.sblock_alloc_buffer((cols, vec), dtype, scope="local")
                        x_loc = T.sblock_alloc_buffer((vec,), dtype, scope="local")
                        part = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        red = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                        T.evaluate(release_dependents(True))
                        col0: T.let[T.int32] = (bx * warps + ty) * cols
                        for b0 in T.serial(T.ceildiv(batch, bt)):
                            for i in T.unroll(bt * cols):
                                acc[i] = T.float32(0)
                            for kk in T.serial(k_iters):
                                k0: T.let[T.int32] = (kk * lanes + tx) * vec
                                if k0 < hidden:
                                    for c in T.unroll(cols):
                                        if col0 + c < live:
                                            for v in T.vectorized(vec):
                                                w_loc[c, v] = w[col0 + c, k0 + v]
                                    for b in T.unroll(bt):
                                        if b0 * bt + b < batch:
                                            for v in T.vectorized(vec):
                                                x_loc[v] = x[b0 * bt + b, k0 + v]
                                            for c in T.unroll(cols):
                                                for v in T.unroll(vec):
                                                    acc[b * cols + c] = acc[b * cols + c] + T.Cast(
                                                        "float32", x_loc[v]
                                                    ) * T.Cast("float32", w_loc[c, v])
                            for b in T.serial(bt):
                                if b0 * bt + b < batch:
                                    for c in T.serial(cols):
                                        part[0] = acc[b * cols + c]
                                        with T.sblock("lane_sum"):
                                            T.reads(part[0])
                                            T.writes(red[0])
                                            T.attr(
                                                T.comm_reducer(
                                                    lambda a0, b0_: a0 + b0_, [T.float32(0)]
                                                ),
                                                "reduce_scope",
                                                T.int32(0),
                                            )
                                            T.tvm_thread_allreduce(
                                                T.uint32(1),
                                                part[0],
                                                True,
                                                red[0],
                                                tx,
                                                dtype="void",
                                            )
                                        if tx == 0 and col0 + c < selection:
                                            out[b0 * bt + b, col0 + c] = T.if_then_else(
                                                col0 + c < live, red[0], neg_inf
                                            )

    return body


def _logits_gpu_mma(hidden: int, rows: int, live: int, selection: int, dtype: str):
    """bf16 GPU kernels on tensor cores: one pass of 16 batch rows up to 16 (decode's batches),
    and one taking 64 rows a pass beyond, so the 1.3 GB table is read once per 64 rows rather
    than once per 16 (on the H200, B = 64 went from 23% to 49% of copy bandwidth). Picked on
    the device by the batch."""
    small = _mma_launch(hidden, rows, live, selection, dtype, n_tiles=2)
    large = _mma_launch(hidden, rows, live, selection, dtype, n_tiles=8)

    @T.macro
    def body(x, w, out, batch):
        if batch <= 16:
            small(x, w, out, batch)
        else:
            large(x, w, out, batch)

    return body


def _mma_launch(hidden: int, rows: int, live: int, selection: int, dtype: str, n_tiles: int):
    """A macro (x, w, out, batch): the kernel taking `n_tiles` n8 batch tiles a pass, on tensor
    cores (mma.sync m16n8k16, fp32 accumulate). A warp owns 16 weight rows (m_tiles m16
    tiles) and the batch as n8 tiles. The dot product does not care in
    which order k is summed, so each lane loads 8 consecutive k of a row with one 128-bit load
    and the same 8 k of the hidden vector, and those 8 feed two mma k16 steps: lane (g, q)
    supplies logical k {2q, 2q+1, 2q+8, 2q+9} of each step, which both operands agree to map
    to physical k 8q' + {0..3} and 8q' + {4..7}. Lane q streams k_lane contiguous k of each
    step, so the four lanes of a row read one contiguous stretch; the next step's weight loads
    are issued before this step's mma (two register stages)."""
    # 128 rows per block. Two m-tiles per warp halve how often each warp re-reads the hidden
    # vectors, which otherwise rival the weight stream in L2 traffic.
    warps, m_tiles, unroll = 4, 2, 2
    step = 32 * unroll
    k_lane = 8 * unroll
    if hidden % (2 * step):
        raise ValueError(f"hidden size {hidden} must be a multiple of {2 * step}")
    n_blocks = -(-selection // (warps * 16 * m_tiles))
    k_pairs = hidden // (2 * step)
    neg_inf = T.float32("-inf")

    @T.macro
    def load_w(
        w: T.Buffer, w_reg: T.Buffer, stage: T.int32, ks: T.int32, row0: T.int32, q: T.int32
    ):
        for u in T.unroll(unroll):
            for h in T.unroll(2 * m_tiles):  # rows row0 + 8h: m-tile h // 2, half h % 2
                if row0 + h * 8 < live:
                    for v in T.vectorized(8):
                        w_reg[stage, u, h, v] = w[row0 + h * 8, ks * step + q * k_lane + u * 8 + v]
                else:
                    for v in T.vectorized(8):
                        w_reg[stage, u, h, v] = T.Cast(dtype, 0)

    @T.macro
    def mma_step(
        x: T.Buffer,
        w_reg: T.Buffer,
        x_reg: T.Buffer,
        a_frag: T.Buffer,
        b_frag: T.Buffer,
        acc: T.Buffer,
        stage: T.int32,
        ks: T.int32,
        b_base: T.int32,
        batch: T.int32,
        g: T.int32,
        q: T.int32,
    ):
        for u in T.unroll(unroll):
            # the batch tiles' hidden-vector loads are all in flight before the first mma
            for nt in T.unroll(n_tiles):
                if b_base + nt * 8 < batch:
                    if b_base + nt * 8 + g < batch:
                        for v in T.vectorized(8):
                            x_reg[nt, v] = x[
                                b_base + nt * 8 + g, ks * step + q * k_lane + u * 8 + v
                            ]
                    else:
                        for v in T.vectorized(8):
                            x_reg[nt, v] = T.Cast(dtype, 0)
            for m in T.unroll(m_tiles):
                for s in T.unroll(2):
                    # fragment order: (g, k0:2) (g+8, k0:2) (g, k2:4) (g+8, k2:4)
                    for e in T.unroll(8):
                        a_frag[m, s, e] = w_reg[
                            stage, u, m * 2 + (e // 2) % 2, s * 4 + (e // 4) * 2 + e % 2
                        ]
            for nt in T.unroll(n_tiles):
                if b_base + nt * 8 < batch:
                    for e in T.unroll(8):
                        b_frag[e] = x_reg[nt, e]
                    for m in T.unroll(m_tiles):
                        for s in T.unroll(2):
                            T.evaluate(
                                mma_bf16(
                                    a_frag.data,
                                    (m * 2 + s) * 8,
                                    b_frag.data,
                                    s * 4,
                                    acc.data,
                                    (m * n_tiles + nt) * 4,
                                )
                            )

    @T.macro
    def launch(x, w, out, batch):
        for bx in T.thread_binding(n_blocks, thread="blockIdx.x"):
            for ty in T.thread_binding(warps, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("logits"):
                        T.reads()
                        T.writes()
                        w_reg = T.sblock_alloc_buffer(
                            (2, unroll, 2 * m_tiles, 8), dtype, scope="local"
                        )
                        x_reg = T.sblock_alloc_buffer((n_tiles, 8), dtype, scope="local")
                        # mma operands are addressed by element offset, so they stay plain bf16
                        # arrays; the 128-bit-loaded x_reg is copied in.
                        a_frag = T.sblock_alloc_buffer((m_tiles, 2, 8), dtype, scope="local")
                        b_frag = T.sblock_alloc_buffer((8,), dtype, scope="local")
                        acc = T.sblock_alloc_buffer(
                            (m_tiles * n_tiles * 4,), "float32", scope="local"
                        )
                        T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                        T.evaluate(release_dependents(True))
                        g: T.let[T.int32] = tx // 4
                        q: T.let[T.int32] = tx % 4
                        row0: T.let[T.int32] = (bx * warps + ty) * 16 * m_tiles + g
                        for b0 in T.serial(T.ceildiv(batch, n_tiles * 8)):
                            for i in T.unroll(m_tiles * n_tiles * 4):
                                acc[i] = T.float32(0)
                            load_w(w, w_reg, 0, 0, row0, q)
                            for kp in T.serial(k_pairs):
                                load_w(w, w_reg, 1, kp * 2 + 1, row0, q)
                                mma_step(
                                    x,
                                    w_reg,
                                    x_reg,
                                    a_frag,
                                    b_frag,
                                    acc,
                                    0,
                                    kp * 2,
                                    b0 * n_tiles * 8,
                                    batch,
                                    g,
                                    q,
                                )
                                if kp + 1 < k_pairs:
                                    load_w(w, w_reg, 0, kp * 2 + 2, row0, q)
                                mma_step(
                                    x,
                                    w_reg,
                                    x_reg,
                                    a_frag,
                                    b_frag,
                                    acc,
                                    1,
                                    kp * 2 + 1,
                                    b0 * n_tiles * 8,
                                    batch,
                                    g,
                                    q,
                                )
                            for m in T.unroll(m_tiles):
                                for nt in T.unroll(n_tiles):
                                    for e in T.unroll(4):
                                        # accumulator: (row g, cols 2q, 2q+1), (row g+8, same)
                                        b: T.let[T.int32] = (
                                            b0 * n_tiles * 8 + nt * 8 + q * 2 + e % 2
                                        )
                                        r: T.let[T.int32] = row0 + m * 16 + (e // 2) * 8
                                        if b < batch and r < selection:
                                            out[b, r] = T.if_then_else(
                                                r < live, acc[(m * n_tiles + nt) * 4 + e], neg_inf
                                            )

    return launch
