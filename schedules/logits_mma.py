"""The bf16 logits kernel on tensor cores (schedules/logits.py holds the contract): the
projection, the pad mask, and each block's greedy-pick triples from its accumulators.

Two launches, picked on the host by the batch:
- up to 16 rows (decode's batches): mma.sync, a warp streaming its weight rows through
  registers and applying them to 16 batch rows;
- beyond, 64 batch rows a block: on sm_90a the prefill GEMM's wgmma ring (TMA, 128-byte
  swizzle; schedules/matmul_wgmma.py) with the weight as A and the batch as B, so the weight
  passes through no register and the hidden vectors are loaded once a block and k step rather
  than once a warp; sm_80 runs mma.sync in the same launch (ptx.is_sm90a).
Both leave their accumulators in mma's m16n8 layout (wgmma's D is the same), so one epilogue
stores, masks and reduces the triples of either.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .gemm_layout import acc_coords
from .matmul_wgmma import BLOCK_K, WgmmaConfig, tensor_maps, wgmma_tile
from .mma_rows import mma_rows
from .pdl import release_dependents, wait_for_producers
from .pick_triples import CHUNK_COLS, merge, start, take, warp_merge
from .ptx import is_sm90a

# 128 rows per block (a pick chunk). Two m-tiles per warp halve how often each warp re-reads
# the hidden vectors, which otherwise rival the weight stream in L2 traffic.
WARPS, M_TILES = 4, 2
assert WARPS * 16 * M_TILES == CHUNK_COLS
SMALL_BATCH = 16  # the largest batch the mma.sync launch takes
# The wide launch: 8 warps (wgmma's two warpgroups of m64) over a chunk's 128 rows, 64 batch
# rows a block. Four stages of 24 KB, two CTAs an SM on sm_90 (one on sm_80): at B = 64 on an
# H100, 85.0% of copy bandwidth against 80.9% with three and 77.9% with five, one CTA an SM
# (docs/results/logits_wide_h100_s42/logits_kernel_stages_*.json, one run).
WIDE_WARPS, WIDE_N_TILES = 8, 8
WIDE = WgmmaConfig(block_n=8 * WIDE_N_TILES, stages=4, tma=True)
assert WIDE_WARPS * 16 == CHUNK_COLS


def logits_gpu_mma(hidden: int, live: int, decodable: int, selection: int, dtype: str):
    """bf16 GPU kernels on tensor cores: the mma.sync launch for up to SMALL_BATCH rows, the
    wide one beyond (module docstring). On the H200 the mma.sync kernel taking 64 rows a pass
    reached 49% of copy bandwidth at B = 64 (23% taking 16 a pass)."""
    small = _small_launch(hidden, live, decodable, selection, dtype)
    wide = _wide_launch(hidden, live, decodable, selection, dtype)

    @T.macro
    def body(x, w, out, ws_val, ws_idx, batch):
        if batch <= SMALL_BATCH:
            small(x, w, out, ws_val, ws_idx, batch)
        else:
            wide(x, w, out, ws_val, ws_idx, batch)

    return body


def _small_launch(hidden: int, live: int, decodable: int, selection: int, dtype: str):
    """A macro (x, w, out, ws_val, ws_idx, batch): WARPS warps of M_TILES m-tiles a block,
    16 batch rows a pass."""
    n_tiles = 2
    block = mma_rows(hidden, dtype, WARPS, M_TILES, n_tiles, _chunk_row(WARPS, M_TILES), live)
    finish = _epilogue(live, decodable, selection, WARPS, M_TILES, n_tiles)
    n_blocks = -(-selection // CHUNK_COLS)

    @T.macro
    def launch(x, w, out, ws_val, ws_idx, batch):
        for bx in T.thread_binding(n_blocks, thread="blockIdx.x"):
            with T.sblock("block"):
                T.reads()
                T.writes()
                red_val = T.sblock_alloc_buffer((WARPS, 8 * n_tiles, 2), "float32", scope="shared")
                red_idx = T.sblock_alloc_buffer((WARPS, 8 * n_tiles), "int32", scope="shared")
                for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                    for tx in T.thread_binding(32, thread="threadIdx.x"):
                        with T.sblock("logits"):
                            T.reads()
                            T.writes()
                            acc = T.sblock_alloc_buffer(
                                (M_TILES * n_tiles * 4,), "float32", scope="local"
                            )
                            T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                            T.evaluate(release_dependents(True))
                            for b0 in T.serial(T.ceildiv(batch, 8 * n_tiles)):
                                block(x, w, acc, batch, bx, ty, tx, b0)
                                finish(acc, out, ws_val, ws_idx, batch, red_val, red_idx, bx,
                                       ty, tx, b0)  # fmt: skip

    return launch


def _wide_launch(hidden: int, live: int, decodable: int, selection: int, dtype: str):
    """A macro (x, w, out, ws_val, ws_idx, batch): a block a (chunk, 64 batch rows), WIDE_WARPS
    warps; sm_90a's wgmma ring, or sm_80's mma.sync with one m-tile a warp."""
    cols = 8 * WIDE_N_TILES
    accumulate = wgmma_tile(cols, hidden, WIDE, None, False, accumulate_only=True)
    maps, encode = tensor_maps(hidden, WIDE)
    block = mma_rows(hidden, dtype, WIDE_WARPS, 1, WIDE_N_TILES, _chunk_row(WIDE_WARPS, 1), live)
    finish = _epilogue(live, decodable, selection, WIDE_WARPS, 1, WIDE_N_TILES)
    n_blocks = -(-selection // CHUNK_COLS)

    @T.macro
    def launch(x, w, out, ws_val, ws_idx, batch):
        encode(w, x, selection, batch)  # on the host: rows past either read as zeros
        for bx in T.thread_binding(n_blocks, thread="blockIdx.x"):
            for by in T.thread_binding(T.ceildiv(batch, cols), thread="blockIdx.y"):
                with T.sblock("block"):
                    T.reads()
                    T.writes()
                    smem = T.sblock_alloc_buffer((WIDE.shared_bytes // 2,), dtype,
                                                 scope="shared.dyn")  # fmt: skip
                    red_val = T.sblock_alloc_buffer((WIDE_WARPS, cols, 2), "float32",
                                                    scope="shared")  # fmt: skip
                    red_idx = T.sblock_alloc_buffer((WIDE_WARPS, cols), "int32", scope="shared")
                    for ty in T.thread_binding(WIDE_WARPS, thread="threadIdx.y"):
                        for tx in T.thread_binding(32, thread="threadIdx.x"):
                            with T.sblock("logits"):
                                T.reads()
                                T.writes()
                                acc = T.sblock_alloc_buffer((cols // 2,), "float32", scope="local")
                                T.evaluate(wait_for_producers(True))  # first: schedules/pdl.py
                                T.evaluate(release_dependents(True))
                                tid: T.let[T.int32] = ty * 32 + tx
                                if is_sm90a():
                                    # the weight is A (a block's 128 rows), the batch B
                                    accumulate(w, x, acc, selection, smem, bx, by, tid, maps,
                                               None, 0, hidden // BLOCK_K)  # fmt: skip
                                else:
                                    block(x, w, acc, batch, bx, ty, tx, by)
                                finish(acc, out, ws_val, ws_idx, batch, red_val, red_idx, bx,
                                       ty, tx, by)  # fmt: skip

    return launch


def _chunk_row(warps: int, m_tiles: int):
    """Block bx's row r: the weight row of a block's chunk of consecutive rows."""
    return lambda bx, r: bx * warps * 16 * m_tiles + r


def _epilogue(live: int, decodable: int, selection: int, warps: int, m_tiles: int, n_tiles: int):
    """A macro (acc, out, ws_val, ws_idx, batch, red_val, red_idx, bx, ty, tx, b0): warp ty's
    accumulators of batch pass b0 (mma's m16n8 layout, gemm_layout.acc_coords, which wgmma's
    D shares; m-tile m, n-tile nt at (m * n_tiles + nt) * 4) stored as logits, rows from `live`
    on as -inf, and the block's triples of each batch row over its decodable columns: a lane's
    rows, the warp's (the 8 lanes of one q) by shuffles, then the warps' in shared memory
    ([warps, cols, 2] and [warps, cols]), in ascending rows."""
    cols = n_tiles * 8  # batch rows of a pass
    neg_inf = T.float32("-inf")

    @T.macro
    def finish(acc, out, ws_val, ws_idx, batch, red_val, red_idx, bx, ty, tx, b0):
        run = T.alloc_local((2,), "float32")
        arg = T.alloc_local((1,), "int32")
        g: T.let[T.int32] = tx // 4
        first: T.let[T.int32] = (bx * warps + ty) * 16 * m_tiles  # the warp's first row
        for m in T.unroll(m_tiles):
            for nt in T.unroll(n_tiles):
                for e in T.unroll(4):
                    er, ec = T.meta_var(acc_coords(tx, e))
                    b: T.let[T.int32] = b0 * cols + nt * 8 + ec
                    r: T.let[T.int32] = first + m * 16 + er
                    if b < batch and r < selection:
                        out[b, r] = T.if_then_else(
                            r < live, acc[(m * n_tiles + nt) * 4 + e], neg_inf
                        )
        for nt in T.unroll(n_tiles):
            if b0 * cols + nt * 8 < batch:  # warp-uniform: a tile past the batch has no row
                for c in T.unroll(2):  # the lane's column pair: elements c and 2 + c
                    start(run, arg)
                    for m in T.unroll(m_tiles):
                        for h in T.unroll(2):  # ascending rows
                            er, _ = T.meta_var(acc_coords(tx, h * 2 + c))
                            rr: T.let[T.int32] = first + m * 16 + er
                            x_r: T.let[T.float32] = T.if_then_else(
                                rr < decodable, acc[(m * n_tiles + nt) * 4 + h * 2 + c], neg_inf
                            )
                            take(run, arg, x_r, rr)
                    warp_merge(run, arg, 4, 3)  # lane bits 2-4: g
                    _, ec = T.meta_var(acc_coords(tx, c))
                    if g == 0:
                        red_val[ty, nt * 8 + ec, 0] = run[0]
                        red_val[ty, nt * 8 + ec, 1] = run[1]
                        red_idx[ty, nt * 8 + ec] = arg[0]
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

    return finish
