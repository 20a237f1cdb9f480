"""decode_wide's GEMV (schedules/gemv.py) for its 16-64-row buckets, as a swapped tensor-core
GEMM: out = epilogue(X · Wᵀ) computed as (W · Xᵀ)ᵀ, the weight wgmma's A and the batch its B.

At 16-64 rows the weight is the only large operand. The GEMV streams it through registers and
reads X from L2 once a warp and step; here sm_90a's wgmma ring (schedules/matmul_wgmma.py:
TMA, 128-byte swizzle, mbarriers) moves a block's 128 weight rows and its `cols` batch rows
into shared memory, and the tensor cores read both from there, so no weight byte passes through
a register and X is loaded once a block and k tile. With `early` (WideMmaConfig), the ring's
first weight tiles load before the kernel waits for the producer of X (schedules/pdl.py).
sm_80 runs mma.sync over the same block (schedules/mma_rows.py: 8 warps of 16 rows) in the
same launch, behind ptx.is_sm90a.

A block: 128 weight rows x `cols` batch rows, 256 threads (wgmma's two warpgroups of m64). With
a SwiGLU (`pair`), its rows are 64 gate rows and their 64 up rows (two TMA boxes), so each
thread of the second warpgroup holds the up values of the outputs its partner in the first
holds the gates of, and hands them over in shared memory. A folded RMSNorm (`rms_eps`, its
weight already in W's columns: compile/norm_fusion.py) takes each batch row's squares from the
X tiles as they land (a stage hook: 16 bytes a thread and stage), so it costs no pass over X.

The CPU variant runs the same blocks and epilogue with each thread's accumulators computed
from memory (their mma layout, gemm_layout.acc_coords) and the squares read from X by the same
thread map, so CPU tests check every index but the ring's data movement, which the emulation
in tests/test_matmul_wgmma.py checks.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .gemm_layout import acc_coords
from .gemm_match import DTYPE, Epilogue
from .gemv_config import WideMmaConfig, cdiv
from .gemv_store import Pair
from .matmul_wgmma import BLOCK_K, BLOCK_M, THREADS, tensor_maps, wgmma_tile
from .mma_rows import mma_rows
from .pdl import release_dependents, wait_for_producers
from .ptx import is_sm90a
from .split_k import k_range
from .split_tickets import LOAD, RESET, SLOT_FLOATS, SLOTS, STORE, TAKE, TICKETS

WARPS = THREADS // 32
CHUNK = 8  # bf16 of one 16-byte chunk of an X tile row
ROW_CHUNKS = BLOCK_K // CHUNK  # chunks of an X tile row: a k tile of one batch row


def paired_row(bx, r, n_out: int):
    """The weight row of block row r with a SwiGLU: rows 0-63 the gate rows of the block's 64
    outputs, 64-127 their up rows (n_out further); past the weight clamped, as such rows feed
    only outputs that are never stored."""
    return T.min(bx * (BLOCK_M // 2) + r % (BLOCK_M // 2), n_out - 1) + r // (BLOCK_M // 2) * n_out


def row_chunk(row, c):
    """The c-th of a k tile's 16-byte chunks of X tile row `row` (chunk p is squared by thread
    p % THREADS, p // THREADS its slot: WideMmaConfig.square_chunks)."""
    return row * ROW_CHUNKS + c


def split_slot(bx, z, j, tid, splits: int, n_acc: int):
    """Where split z of row tile bx keeps thread tid's accumulator j in the workspace
    (schedules/split_tickets.py): a tile's splits side by side, a thread's values THREADS
    apart, so a warp's stores and loads are coalesced."""
    return ((bx * splits + z) * n_acc + j) * THREADS + tid


def wide_mma_launch(
    n: int,
    k: int,
    cfg: WideMmaConfig,
    gpu: bool,
    epilogue: Epilogue,
    rms_eps: float | None,
    pair: Pair | None = None,
):
    """A macro (x, w, out, extras, batch): row tiles on blockIdx.x, `cfg.cols` batch rows a
    block on blockIdx.y; out [batch, n] = epilogue(X · Wᵀ) (times each row's 1 / rms with
    `rms_eps`), or with `pair` out [batch, n / 2] column c = pair(epilogue of W row c,
    epilogue of W row n / 2 + c), as gemv_kernel defines them."""
    cfg.check()
    if k % (2 * BLOCK_K):
        raise ValueError(f"k {k} must be a multiple of {2 * BLOCK_K}")
    cols, paired, rms = cfg.cols, pair is not None, rms_eps is not None
    n_out = n // 2 if paired else n
    outs = BLOCK_M // 2 if paired else BLOCK_M  # output columns a block
    tiles, n_acc, sq_n = cdiv(n_out, outs), cols // 2, cfg.square_chunks
    k_tiles, splits = k // BLOCK_K, cfg.splits
    if splits > 1 and (paired or rms or tiles > TICKETS or tiles * splits > SLOTS
                       or n_acc * THREADS > SLOT_FLOATS or splits * 2 > k_tiles):  # fmt: skip
        raise ValueError(f"{cfg} for {n} x {k}: a split tile takes no norm or SwiGLU, and "
                         f"{TICKETS} tiles, {SLOTS} blocks, 2 k tiles a split at most")
    up_elems = (THREADS // 2) * n_acc if paired else 1
    wg = cfg.wgmma

    def weight_row(bx, r):
        # rows past the weight clamped: they feed only outputs that are never stored
        if not paired:
            return T.min(bx * BLOCK_M + r, n - 1)
        return paired_row(bx, r, n_out)

    def out_coords(bx, by, ty, tx, j):
        # (batch row, output column) of a thread's accumulator j (n8 tile j // 4)
        er, ec = acc_coords(tx, j % 4)
        return by * cols + j // 4 * 8 + ec, bx * outs + ty % (outs // 16) * 16 + er

    def scaled(v, rstd, b_in_block):
        return v * rstd[b_in_block] if rms else v

    @T.macro
    def squares_of_stage(smem, at, tid, sq):
        for i in T.unroll(sq_n):
            p: T.let[T.int32] = tid + i * THREADS
            if p < cols * ROW_CHUNKS:
                for v in T.unroll(CHUNK):
                    xv: T.let[T.float32] = T.Cast("float32", smem[at + p * CHUNK + v])
                    sq[i] = sq[i] + xv * xv

    @T.macro
    def squares_of_x(x, sq, sq_base, by, tid, batch):
        # the stage hook's chunks, read from X (sm_80 and the CPU)
        for kt in T.serial(k_tiles):
            for i in T.unroll(sq_n):
                p: T.let[T.int32] = tid + i * THREADS
                if p < cols * ROW_CHUNKS and by * cols + p // ROW_CHUNKS < batch:
                    for v in T.serial(CHUNK):
                        xv = T.meta_var(
                            T.Cast("float32", x[by * cols + p // ROW_CHUNKS,
                                                kt * BLOCK_K + p % ROW_CHUNKS * CHUNK + v])
                        )  # fmt: skip
                        sq[sq_base + i] = sq[sq_base + i] + xv * xv

    accumulate = wgmma_tile(
        cols, k, wg, None, False, accumulate_only=True, a_pair=n_out if paired else 0,
        stage_hook=squares_of_stage if rms else None, early_a=cfg.early,
    )  # fmt: skip
    maps, encode = tensor_maps(k, wg, a_halves=paired)
    block = mma_rows(k, DTYPE, WARPS, 1, cols // 8, weight_row)

    @T.macro
    def hand_over(acc, base, sq, sq_base, sq_part, up_sh, tid):
        # phase 1: a thread's squares and (second warpgroup) up values into shared memory
        if rms:
            for i in T.unroll(sq_n):
                sq_part[tid, i] = sq[sq_base + i]
        if paired:
            if tid >= THREADS // 2:
                for j in T.unroll(n_acc):
                    up_sh[(tid - THREADS // 2) * n_acc + j] = acc[base + j]

    @T.macro
    def row_norms(sq_part, rstd, tid):
        # phase 2: batch row `tid`'s 1 / rms, its 8 chunks' squares summed in order
        total = T.alloc_local((1,), "float32")
        if rms:
            if tid < cols:
                total[0] = T.float32(0)
                for c in T.unroll(ROW_CHUNKS):
                    p = T.meta_var(row_chunk(tid, c))
                    total[0] = total[0] + sq_part[p % THREADS, p // THREADS]
                rstd[tid] = T.rsqrt(total[0] / T.float32(k) + T.float32(rms_eps))

    @T.macro
    def store(acc, base, up_sh, rstd, out, extras, bx, by, tid, batch):
        # phase 3: the first warpgroup (paired) or every thread stores its outputs
        ty: T.let[T.int32] = tid // 32
        tx: T.let[T.int32] = tid % 32
        if not paired or tid < THREADS // 2:
            for j in T.unroll(n_acc):
                b, c = T.meta_var(out_coords(bx, by, ty, tx, j))
                if b < batch and c < n_out:
                    gate = T.meta_var(scaled(acc[base + j], rstd, b - by * cols))
                    if paired:
                        up = T.meta_var(scaled(up_sh[tid * n_acc + j], rstd, b - by * cols))
                        out[b, c] = pair(epilogue(gate, b, c, extras),
                                         epilogue(up, b, n_out + c, extras))  # fmt: skip
                    else:
                        out[b, c] = epilogue(gate, b, c, extras)

    @T.macro
    def reduce_splits(acc, ticket, bx, by, z, tid):
        # publish this split's partial; the block that draws the last ticket sums all of them
        # in split order (its own too, from memory, so the order never depends on timing).
        # The workspace and tickets hold one batch block: a later one ran its tile whole in
        # split 0, which alone stores
        split_here: T.let[T.bool] = by == 0
        if split_here:
            for j in T.unroll(n_acc):
                at = T.meta_var(split_slot(bx, z, j, tid, splits, n_acc))
                T.evaluate(T.call_extern("void", STORE, at, acc[j]))
        T.tvm_storage_sync("shared")
        if tid == 0:
            if split_here:
                ticket[0] = T.call_extern("int32", TAKE, bx)
            else:
                ticket[0] = T.if_then_else(z == 0, splits - 1, 0)
        T.tvm_storage_sync("shared")
        last: T.let[T.bool] = ticket[0] == splits - 1 and by == 0
        if last:
            for j in T.unroll(n_acc):
                acc[j] = T.float32(0)
                for zz in T.serial(splits):
                    at = T.meta_var(split_slot(bx, zz, j, tid, splits, n_acc))
                    acc[j] = acc[j] + T.call_extern("float32", LOAD, at)
            if tid == 0:
                T.evaluate(T.call_extern("void", RESET, bx))

    @T.macro
    def block_gpu(x, w, out, extras, batch, maps, bx, by, z):
        with T.sblock("block"):
            T.reads()
            T.writes()
            smem = T.sblock_alloc_buffer((wg.shared_bytes // 2,), DTYPE, scope="shared.dyn")
            sq_part = T.sblock_alloc_buffer((THREADS, sq_n), "float32", scope="shared")
            rstd = T.sblock_alloc_buffer((cols,), "float32", scope="shared")
            up_sh = T.sblock_alloc_buffer((up_elems,), "float32", scope="shared")
            ticket = T.sblock_alloc_buffer((1,), "int32", scope="shared")
            for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("gemv"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((n_acc,), "float32", scope="local")
                        sq = T.sblock_alloc_buffer((sq_n,), "float32", scope="local")
                        if cfg.dependent and not cfg.early:  # first: schedules/pdl.py
                            T.evaluate(wait_for_producers(True))
                            T.evaluate(release_dependents(True))
                        elif not cfg.dependent:  # its producer has ended: nothing to wait for
                            T.evaluate(release_dependents(True))
                        tid: T.let[T.int32] = ty * 32 + tx
                        for i in T.unroll(sq_n):
                            sq[i] = T.float32(0)
                        if is_sm90a():
                            if splits > 1:  # a later batch block's split 0: the whole tile
                                kt0, kc = T.meta_var(k_range(z, splits, k_tiles))
                                # (arithmetic: a select here becomes a branch at every use)
                                split_block: T.let[T.int32] = T.Cast("int32", by == 0)
                                first: T.let[T.int32] = split_block * kt0
                                count: T.let[T.int32] = k_tiles + split_block * (kc - k_tiles)
                                if by == 0 or z == 0:
                                    accumulate(w, x, acc, n, smem, bx, by, tid, maps, sq, first,
                                               count)  # fmt: skip
                                reduce_splits(acc, ticket, bx, by, z, tid)
                            else:
                                accumulate(w, x, acc, n, smem, bx, by, tid, maps, sq, 0, k_tiles)
                        else:
                            if cfg.early:  # the ring's macro waits on sm_90a
                                T.evaluate(wait_for_producers(True))
                                T.evaluate(release_dependents(True))
                            if splits > 1:  # sm_80: split 0 runs the tile whole
                                if z == 0:
                                    block(x, w, acc, batch, bx, ty, tx, by)
                                if tid == 0:
                                    ticket[0] = T.if_then_else(z == 0, splits - 1, 0)
                            else:
                                block(x, w, acc, batch, bx, ty, tx, by)
                            if rms:
                                squares_of_x(x, sq, 0, by, tid, batch)
                        hand_over(acc, 0, sq, 0, sq_part, up_sh, tid)
                        T.tvm_storage_sync("shared")
                        row_norms(sq_part, rstd, tid)
                        T.tvm_storage_sync("shared")
                        if splits > 1:
                            mine: T.let[T.bool] = ticket[0] == splits - 1
                            if mine:
                                store(acc, 0, up_sh, rstd, out, extras, bx, by, tid, batch)
                        else:
                            store(acc, 0, up_sh, rstd, out, extras, bx, by, tid, batch)

    @T.macro
    def launch_gpu(x, w, out, extras, batch):
        encode(w, x, n, batch)  # on the host: rows past either read as zeros
        for bx in T.thread_binding(tiles, thread="blockIdx.x"):
            for by in T.thread_binding(T.ceildiv(batch, cols), thread="blockIdx.y"):
                if splits > 1:
                    for z in T.thread_binding(splits, thread="blockIdx.z"):
                        block_gpu(x, w, out, extras, batch, maps, bx, by, z)
                else:
                    block_gpu(x, w, out, extras, batch, maps, bx, by, 0)

    @T.macro
    def launch_cpu(x, w, out, extras, batch):
        # the GPU's phases as loop nests over the block's threads (a nest is a barrier)
        for by in T.serial(T.ceildiv(batch, cols)):
            for bx in T.parallel(tiles):
                with T.sblock("block"):
                    T.reads()
                    T.writes()
                    acc = T.sblock_alloc_buffer((THREADS * n_acc,), "float32")
                    sq = T.sblock_alloc_buffer((THREADS * sq_n,), "float32")
                    sq_part = T.sblock_alloc_buffer((THREADS, sq_n), "float32")
                    rstd = T.sblock_alloc_buffer((cols,), "float32")
                    up_sh = T.sblock_alloc_buffer((up_elems,), "float32")
                    part = T.sblock_alloc_buffer((1,), "float32")
                    for tid in T.serial(THREADS):
                        for j in T.serial(n_acc):
                            b, _c = T.meta_var(out_coords(bx, by, tid // 32, tid % 32, j))
                            er, _ec = T.meta_var(acc_coords(tid % 32, j % 4))
                            row: T.let[T.int32] = weight_row(bx, tid // 32 * 16 + er)
                            acc[tid * n_acc + j] = T.float32(0)
                            # the GPU's partials, in split order (a later batch block: one)
                            n_z: T.let[T.int32] = T.if_then_else(by == 0, splits, 1)
                            for z in T.serial(n_z):
                                kt0, kc = T.meta_var(k_range(z, n_z, k_tiles))
                                part[0] = T.float32(0)
                                for kk in T.serial(kc * BLOCK_K):
                                    at: T.let[T.int32] = kt0 * BLOCK_K + kk
                                    part[0] = part[0] + T.Cast("float32", w[row, at]) * T.Cast(
                                        "float32", x[T.min(b, batch - 1), at]
                                    )
                                acc[tid * n_acc + j] = acc[tid * n_acc + j] + part[0]
                        for i in T.serial(sq_n):
                            sq[tid * sq_n + i] = T.float32(0)
                        if rms:
                            squares_of_x(x, sq, tid * sq_n, by, tid, batch)
                    for tid in T.serial(THREADS):
                        hand_over(acc, tid * n_acc, sq, tid * sq_n, sq_part, up_sh, tid)
                    for tid in T.serial(THREADS):
                        row_norms(sq_part, rstd, tid)
                    for tid in T.serial(THREADS):
                        store(acc, tid * n_acc, up_sh, rstd, out, extras, bx, by, tid, batch)

    return launch_gpu if gpu else launch_cpu
