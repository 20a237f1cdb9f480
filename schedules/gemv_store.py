"""The decode GEMV's rows (the kernel: schedules/gemv_body.py): which weight row each row of a
block reads, and the epilogue store, which sums a row's partial sums over the warps (times its
1/rms where a norm is folded in) and stores epilogue(sum); or, where the block pairs the gate
and up rows of a gated activation, pair(epilogue(gate), epilogue(up)) for their output column.
The store reads the index maps by these names, so tests mutate them here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tvm import tirx
from tvm.script import tirx as T

from .gemm_match import Epilogue
from .gemv_config import TILE_COLS, GemvConfig, cdiv
from .gemv_layout import Index, out_row, pair_rows, paired_row

Pair = Callable[[tirx.Expr, tirx.Expr], tirx.Expr]  # (gate, up) epilogue values -> stored value


class Rows(NamedTuple):
    tiles: int  # row tiles: blocks a pass
    weight_row: Callable[[Index], Index]  # a block's row tile * rows + r -> its weight row
    store: Any  # macro (out, extras, part, wk, tx, tile, col, t, batch, sq_sh, early)
    # macro (extras, early, wk, tx, tile, col, batch): the epilogue's extras of every output
    # the thread stores, into the local buffer `early` (`early_size` values), or None
    load_early: Any
    early_size: int


class _Early:
    """An extra of one output, loaded early into a register: indexed like the extra's buffer
    by the epilogue, read from the register."""

    def __init__(self, early, at, dtype: str):
        self.early, self.at, self.dtype = early, at, dtype

    def __getitem__(self, _index):
        return T.Cast(self.dtype, self.early[self.at])


def block_rows(
    n: int,
    k: int,
    cfg: GemvConfig,
    epilogue: Epilogue,
    rms_eps: float | None,
    pair: Pair | None,
    extra_shapes: tuple[str, ...] = (),
) -> Rows:
    """The rows of the kernel of one config over a weight of n rows: n outputs, or n / 2 with
    `pair` (gemv_kernel's `swiglu`). The epilogue's extras (a residual) may be loaded at the
    kernel's start, so their latency hides behind the weight stream instead of following it:
    not where `pair` takes two columns a thread."""
    wks, rb, rms = cfg.warps_k, cfg.rows, rms_eps is not None
    paired = pair is not None
    n_out, ob = (n // 2, rb // 2) if paired else (n, rb)  # output columns: all, a block's
    outs = ob * TILE_COLS  # outputs of a block per n-tile
    store_iters = cdiv(outs, cfg.threads)
    # one extra (a residual, a bias), held as fp32 (exact for bf16 and fp32 extras)
    early_size = cfg.n_tiles * store_iters if len(extra_shapes) == 1 and not paired else 0

    def output(i, wk, tx, tile, col, t):
        # (o, r, row, b): a thread's i-th output of n-tile t; consecutive threads take
        # consecutive outputs, so stores are coalesced
        o = i * cfg.threads + wk * 32 + tx
        return o, o % ob, tile * ob + o % ob, out_row(col, t, o // ob)

    def weight_row(v):
        # rows past n are clamped: they feed only accumulators that are never stored
        if not paired:
            return T.min(v, n - 1)
        c, up = paired_row(v)
        return T.min(c, n_out - 1) + up * n_out

    def row_squares(sq_sh, c):
        return sum((sq_sh[w2, c] for w2 in range(1, wks)), sq_sh[0, c])

    @T.macro
    def row_sum(total, i, part, c, r, t, sq_sh):
        # total[i]: row r's sums over the warps for batch column c, times the row's 1 / rms
        total[i] = part[0, c, r]
        for w2 in T.unroll(1, wks):
            total[i] = total[i] + part[w2, c, r]
        if rms:  # from every warp's squares of it
            ss = T.meta_var(row_squares(sq_sh, t * TILE_COLS + c))
            total[i] = total[i] * T.rsqrt(ss / T.float32(k) + T.float32(rms_eps))

    def early_at(t, i):
        return t * store_iters + i

    def extra_at(extras, b, row):
        return {"mn": lambda: extras[0][b, row], "n": lambda: extras[0][row],
                "m": lambda: extras[0][b]}[extra_shapes[0]]()  # fmt: skip

    @T.macro
    def load_early(extras, early, wk, tx, tile, col, batch):
        for t in T.unroll(cfg.n_tiles):
            for i in T.unroll(store_iters):
                at = T.meta_var(output(i, wk, tx, tile, col, t))
                # clamped: an output past n or the batch is never stored
                rc: T.let[T.int32] = T.min(at[2], n_out - 1)
                bc: T.let[T.int32] = T.min(at[3], batch - 1)
                early[early_at(t, i)] = T.Cast("float32", extra_at(extras, bc, rc))

    @T.macro
    def store(out, extras, part, wk, tx, tile, col, t, batch, sq_sh, early):
        total = T.sblock_alloc_buffer((1 + paired,), "float32", scope="local")
        for i in T.unroll(store_iters):
            o, r, row, b = T.meta_var(output(i, wk, tx, tile, col, t))
            if o < outs and row < n_out and b < batch:
                if paired:
                    gate, up = T.meta_var(pair_rows(r))
                    row_sum(total, 0, part, o // ob, gate, t, sq_sh)
                    row_sum(total, 1, part, o // ob, up, t, sq_sh)
                    out[b, row] = pair(epilogue(total[0], b, row, extras),
                                       epilogue(total[1], b, n_out + row, extras))  # fmt: skip
                else:
                    row_sum(total, 0, part, o // ob, r, t, sq_sh)
                    if early is None:
                        out[b, row] = epilogue(total[0], b, row, extras)
                    else:
                        held = T.meta_var(_Early(early, early_at(t, i), str(extras[0].dtype)))
                        out[b, row] = epilogue(total[0], b, row, [held])

    return Rows(cdiv(n_out, ob), weight_row, store, load_early if early_size else None,
                early_size)  # fmt: skip
