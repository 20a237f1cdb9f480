"""The bf16 logits kernel on tensor cores (schedules/logits.py holds the contract): the
projection, the pad mask, and each block's greedy-pick triples from its accumulators."""

from __future__ import annotations

from tvm.script import tirx as T

from .pdl import release_dependents, wait_for_producers
from .pick_triples import CHUNK_COLS, merge, start, take, warp_merge
from .ptx import mma_bf16

# 128 rows per block (a pick chunk). Two m-tiles per warp halve how often each warp re-reads
# the hidden vectors, which otherwise rival the weight stream in L2 traffic.
WARPS, M_TILES = 4, 2
assert WARPS * 16 * M_TILES == CHUNK_COLS


def logits_gpu_mma(hidden: int, live: int, decodable: int, selection: int, dtype: str):
    """bf16 GPU kernels on tensor cores: one pass of 16 batch rows up to 16 (decode's batches),
    and one taking 64 rows a pass beyond, so the 1.3 GB table is read once per 64 rows rather
    than once per 16 (on the H200, B = 64 went from 23% to 49% of copy bandwidth). Picked on
    the device by the batch."""
    small = _mma_launch(hidden, live, decodable, selection, dtype, n_tiles=2)
    large = _mma_launch(hidden, live, decodable, selection, dtype, n_tiles=8)

    @T.macro
    def body(x, w, out, ws_val, ws_idx, batch):
        if batch <= 16:
            small(x, w, out, ws_val, ws_idx, batch)
        else:
            large(x, w, out, ws_val, ws_idx, batch)

    return body


def _mma_launch(hidden: int, live: int, decodable: int, selection: int, dtype: str, n_tiles: int):
    """A macro (x, w, out, ws_val, ws_idx, batch): the kernel taking `n_tiles` n8 batch tiles
    a pass, on tensor cores (mma.sync m16n8k16, fp32 accumulate). A warp owns 16 weight rows
    (m_tiles m16 tiles) and the batch as n8 tiles. The dot product does not care in
    which order k is summed, so each lane loads 8 consecutive k of a row with one 128-bit load
    and the same 8 k of the hidden vector, and those 8 feed two mma k16 steps: lane (g, q)
    supplies logical k {2q, 2q+1, 2q+8, 2q+9} of each step, which both operands agree to map
    to physical k 8q' + {0..3} and 8q' + {4..7}. Lane q streams k_lane contiguous k of each
    step, so the four lanes of a row read one contiguous stretch; the next step's weight loads
    are issued before this step's mma (two register stages)."""
    warps, m_tiles, unroll = WARPS, M_TILES, 2
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

    cols = n_tiles * 8  # batch columns of a pass

    @T.macro
    def pick_triples(acc, run, arg, red_val, red_idx, ws_val, ws_idx, bx, ty, tx, row0, b0, batch):
        # each batch column's triple over the block's decodable rows: a lane's 4 rows, the
        # warp's (the 8 lanes of one q) by shuffles, then the 4 warps' in shared memory
        g, q = T.meta_var((tx // 4, tx % 4))
        for nt in T.unroll(n_tiles):
            if b0 * cols + nt * 8 < batch:  # warp-uniform: a tile past the batch has no row
                for c in T.unroll(2):  # the lane's batch column nt * 8 + 2q + c
                    start(run, arg)
                    for m in T.unroll(m_tiles):
                        for h in T.unroll(2):  # ascending rows
                            r: T.let[T.int32] = row0 + m * 16 + h * 8
                            x_r: T.let[T.float32] = T.if_then_else(
                                r < decodable, acc[(m * n_tiles + nt) * 4 + h * 2 + c], neg_inf
                            )
                            take(run, arg, x_r, r)
                    warp_merge(run, arg, 4, 3)  # lane bits 2-4: g
                    if g == 0:
                        red_val[ty, nt * 8 + q * 2 + c, 0] = run[0]
                        red_val[ty, nt * 8 + q * 2 + c, 1] = run[1]
                        red_idx[ty, nt * 8 + q * 2 + c] = arg[0]
        T.tvm_storage_sync("shared")
        if ty == 0:
            for cc in T.unroll(-(-cols // 32)):
                col: T.let[T.int32] = T.min(cc * 32 + tx, cols - 1)
                start(run, arg)
                for v in T.unroll(warps):  # ascending rows
                    merge(run, arg, red_val[v, col, 0], red_idx[v, col], red_val[v, col, 1])
                if cc * 32 + tx < cols and b0 * cols + col < batch:
                    ws_val[b0 * cols + col, bx, 0] = run[0]
                    ws_val[b0 * cols + col, bx, 1] = run[1]
                    ws_idx[b0 * cols + col, bx] = arg[0]
        T.tvm_storage_sync("shared")  # before the next pass's writes

    @T.macro
    def launch(x, w, out, ws_val, ws_idx, batch):
        for bx in T.thread_binding(n_blocks, thread="blockIdx.x"):
            with T.sblock("block"):
                T.reads()
                T.writes()
                red_val = T.sblock_alloc_buffer((warps, cols, 2), "float32", scope="shared")
                red_idx = T.sblock_alloc_buffer((warps, cols), "int32", scope="shared")
                for ty in T.thread_binding(warps, thread="threadIdx.y"):
                    for tx in T.thread_binding(32, thread="threadIdx.x"):
                        with T.sblock("logits"):
                            T.reads()
                            T.writes()
                            w_reg = T.sblock_alloc_buffer(
                                (2, unroll, 2 * m_tiles, 8), dtype, scope="local"
                            )
                            x_reg = T.sblock_alloc_buffer((n_tiles, 8), dtype, scope="local")
                            # mma operands are addressed by element offset, so they stay plain
                            # bf16 arrays; the 128-bit-loaded x_reg is copied in.
                            a_frag = T.sblock_alloc_buffer((m_tiles, 2, 8), dtype, scope="local")
                            b_frag = T.sblock_alloc_buffer((8,), dtype, scope="local")
                            acc = T.sblock_alloc_buffer(
                                (m_tiles * n_tiles * 4,), "float32", scope="local"
                            )
                            run = T.sblock_alloc_buffer((2,), "float32", scope="local")
                            arg = T.sblock_alloc_buffer((1,), "int32", scope="local")
                            T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                            T.evaluate(release_dependents(True))
                            g: T.let[T.int32] = tx // 4
                            q: T.let[T.int32] = tx % 4
                            row0: T.let[T.int32] = (bx * warps + ty) * 16 * m_tiles + g
                            for b0 in T.serial(T.ceildiv(batch, cols)):
                                for i in T.unroll(m_tiles * n_tiles * 4):
                                    acc[i] = T.float32(0)
                                load_w(w, w_reg, 0, 0, row0, q)
                                for kp in T.serial(k_pairs):
                                    load_w(w, w_reg, 1, kp * 2 + 1, row0, q)
                                    mma_step(x, w_reg, x_reg, a_frag, b_frag, acc, 0, kp * 2,
                                             b0 * cols, batch, g, q)  # fmt: skip
                                    if kp + 1 < k_pairs:
                                        load_w(w, w_reg, 0, kp * 2 + 2, row0, q)
                                    mma_step(x, w_reg, x_reg, a_frag, b_frag, acc, 1, kp * 2 + 1,
                                             b0 * cols, batch, g, q)  # fmt: skip
                                for m in T.unroll(m_tiles):
                                    for nt in T.unroll(n_tiles):
                                        for e in T.unroll(4):
                                            # accumulator: (row g, cols 2q, 2q+1), (row g+8, ..)
                                            b: T.let[T.int32] = b0 * cols + nt * 8 + q * 2 + e % 2
                                            r: T.let[T.int32] = row0 + m * 16 + (e // 2) * 8
                                            if b < batch and r < selection:
                                                out[b, r] = T.if_then_else(
                                                    r < live,
                                                    acc[(m * n_tiles + nt) * 4 + e],
                                                    neg_inf,
                                                )
                                pick_triples(acc, run, arg, red_val, red_idx, ws_val, ws_idx, bx,
                                             ty, tx, row0, b0, batch)  # fmt: skip

    return launch
