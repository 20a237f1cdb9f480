"""Decode GEMV for batches of 1-7: out = epilogue(X · Wᵀ), X [batch, k] bf16 (batch symbolic),
W [n, k] bf16 as stored, fp32 accumulation, then the elementwise epilogue gemm_match extracted
(the cast to bf16, a residual add, an activation, ...).

A decode step is a weight stream: every weight element is read once and applied to all rows
of the batch. On the GPU the product runs on mma.sync m16n8k16 with the weight as A (16 rows a
tile) and the batch as B (8 columns, rows past the batch clamped, their outputs never stored):
tensor cores take the batch for free, where SIMT FMAs would cost 7 per weight element at
batch 7. Each lane issues 128-bit loads of 8 consecutive k of a weight row and the same 8 k of
X; mma sums over k in any order, so the physical k a lane loads are mapped to mma's logical k
(`frag_source`), as in schedules/logits.py. Lanes q = 0..3 of a row read 64 contiguous bytes
per load instruction.

Split-K inside the block: a block owns 16 * m_tiles weight rows and its `warps_k` warps take
interleaved k steps of those rows (neighbouring warps read neighbouring stretches of each
row), each keeping `stages` steps of loads in flight in a register ring. The warps' partial
sums meet in shared memory, and the block sums them and applies the epilogue. Small n (2,560
rows: 160 tiles) thus still puts thousands of warps on the weight, in one kernel, with no
workspace and no second pass.

The CPU variant is the same loop nest, except that a lane computes its accumulators from
memory instead of from mma fragments: CPU tests check every index but the fragment layout,
which tests/test_gemv_kernel.py checks by emulating the register ring and mma in numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.script import tirx as T
from tvm.target import Target

from .gemm_match import DTYPE, MAX_EXTRA_INPUTS, Epilogue, match_gemm, plain_epilogue
from .matmul import MIN_SM, ROWS_ATTR, acc_coords
from .ptx import mma_bf16

VEC = 8  # bf16 elements of one 128-bit load
COLS = 8  # batch rows one pass takes: mma's n8
# The GPU the grid is sized for: H100/H200 SXM (an A100 has 108 SMs); a library is built
# without one, so this cannot be read from the device.
SMS = 132
MAX_THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536
KERNEL_ATTR = "qwen35.kernel"  # set to "gemv" on the kernel, so tests can tell it is ours


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # ceil(a / b)


@dataclass(frozen=True)
class GemvConfig:
    m_tiles: int = 1  # m16 weight tiles a block owns
    warps_k: int = 8  # warps of a block, splitting its k steps between them
    unroll: int = 2  # 128-bit loads per lane per weight row and k step
    stages: int = 2  # k steps of loads in flight per warp

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles

    @property
    def step(self) -> int:
        return 4 * VEC * self.unroll  # k per step: 4 lanes of a row, `unroll` loads each

    @property
    def threads(self) -> int:
        return 32 * self.warps_k

    def check(self) -> None:
        """Raise ValueError if the kernel cannot be built with these numbers."""
        if not (1 <= self.m_tiles <= 4 and 1 <= self.warps_k <= 32):
            raise ValueError(f"{self}: m_tiles 1-4, warps_k 1-32")
        if not (1 <= self.unroll <= 8 and 1 <= self.stages <= 8):
            raise ValueError(f"{self}: unroll and stages 1-8")


def est_registers(cfg: GemvConfig) -> int:
    """Registers a lane needs (fitted to ptxas 13.0 on sm_90): the load ring plus ~24."""
    ring = cfg.stages * cfg.unroll * (2 * cfg.m_tiles + 1) * 4
    return 24 + cdiv(ring * 115, 100)


def min_blocks_per_sm(n: int, cfg: GemvConfig) -> int:
    """Blocks an SM must hold for every row tile to run in one wave on SMS multiprocessors
    (every block streams its rows' whole k, so a second wave would nearly double the time);
    passed to ptxas as __launch_bounds__' second argument, so registers cannot prevent it.
    Lowered where the register budget would fall below `est_registers` (spills cost more)."""
    need = cdiv(cdiv(n, cfg.rows), SMS)
    most = min(MAX_THREADS_PER_SM // cfg.threads, 32)
    while most > 1 and REGISTERS_PER_SM // (cfg.threads * most) < est_registers(cfg):
        most -= 1
    return max(1, min(need, most))


def default_config(n: int, k: int) -> GemvConfig:
    """Two m-tiles a block for wide weights (half the X loads per weight byte), one for narrow
    ones (more blocks); then the most k-splitting warps (8, 4, 2, 1), and the deepest ring (3
    or 2 steps), that keep every row tile in one wave, with at least one k step a warp."""
    m_tiles = 2 if n >= 8192 else 1
    steps = cdiv(k, GemvConfig().step)
    for warps_k in (8, 4, 2, 1):
        for stages in (3, 2):
            cfg = GemvConfig(m_tiles=m_tiles, warps_k=warps_k, stages=stages)
            if warps_k <= steps and cdiv(n, cfg.rows) <= SMS * min_blocks_per_sm(n, cfg):
                return cfg
    return GemvConfig(m_tiles=m_tiles, warps_k=1)


# ---- index maps: used by the kernel (TIR expressions) and the test's emulator (ints) --------

Index = int | tirx.Expr


def lane_coords(lane: Index) -> tuple[Index, Index]:
    """(g, q): a lane loads weight rows g and g + 8 of each m-tile and X row g (mma's group and
    thread-in-group)."""
    return lane // 4, lane % 4


def warp_step(j: Index, warp: Index, warps_k: int) -> Index:
    """The k step a warp takes j-th: interleaved, so a block's warps read adjacent stretches."""
    return j * warps_k + warp


def load_k(ks: Index, u: Index, q: Index, step: int) -> Index:
    """First k of load u of lane q in step ks: the four lanes of a row cover 64 contiguous
    bytes per load instruction."""
    return ks * step + u * 4 * VEC + q * VEC


def load_row(tile: Index, h: Index, g: Index, m_tiles: int) -> Index:
    """Weight row of a lane's h-th row register set: m-tile h // 2, row g (h even) or g + 8."""
    return tile * 16 * m_tiles + h // 2 * 16 + h % 2 * 8 + g


def frag_source(m: Index, s: Index, e: Index) -> tuple[Index, Index]:
    """(h, v): A fragment element e of m-tile m in half s of a load comes from element v of row
    register set h. mma's A layout is a0a1 (row g, k 2q..2q+1), a2a3 (g + 8, same k), a4a5
    (g, k 2q+8..2q+9), a6a7 (g + 8, same k); half s maps logical k {2q, 2q+1, 2q+8, 2q+9} to
    physical {4s, .., 4s + 3} of the 8 loaded, and X's B fragment (b0b1: k 2q..2q+1, b2b3:
    k 2q+8..2q+9) is loaded elements 4s..4s+3, the same map."""
    return m * 2 + e // 2 % 2, s * 4 + e // 4 * 2 + e % 2


# ---- the kernel ----------------------------------------------------------------------------


def gemv_kernel(
    n: int,
    k: int,
    target: Target,
    config: GemvConfig | None = None,
    extra_shapes: tuple[str, ...] = (),
    extra_dtypes: tuple[str, ...] = (),
    out_dtype: str = "float32",
    epilogue: Epilogue = plain_epilogue,
) -> tirx.PrimFunc:
    """The kernel with parameters (X [batch, k], W [n, k], *extras, out [batch, n]); extras are
    indexed [batch, n], [n] or [batch] (`extra_shapes` "mn", "n", "m"). `epilogue(acc, row,
    col, extras)` gives out[row, col] from the fp32 sum."""
    cfg = config or default_config(n, k)
    cfg.check()
    if k % VEC:
        raise ValueError(f"k {k} must be a multiple of {VEC} (128-bit loads)")
    if len(extra_shapes) > MAX_EXTRA_INPUTS or len(extra_shapes) != len(extra_dtypes):
        raise ValueError(f"at most {MAX_EXTRA_INPUTS} extra inputs, each with a dtype")
    gpu = target.kind.name == "cuda"
    min_blocks = min_blocks_per_sm(n, cfg)
    mt, wks, unroll, stages, rb, step = (
        cfg.m_tiles, cfg.warps_k, cfg.unroll, cfg.stages, cfg.rows, cfg.step
    )  # fmt: skip
    n_steps = cdiv(k, step)
    per_warp = cdiv(n_steps, wks)
    iters = cdiv(per_warp, stages)
    outs = rb * COLS  # outputs of a block per pass
    store_iters = cdiv(outs, cfg.threads)

    def in_k(k0):
        return k0 < k if k % step else True  # a load can fall past k only then

    def blocks(extent):
        return T.thread_binding(extent, thread="blockIdx.x") if gpu else T.parallel(extent)

    def passes(extent):
        return T.thread_binding(extent, thread="blockIdx.y") if gpu else T.serial(extent)

    def warps():
        return T.thread_binding(wks, thread="threadIdx.y") if gpu else T.serial(wks)

    def lanes():
        return T.thread_binding(32, thread="threadIdx.x") if gpu else T.serial(32)

    @T.macro
    def load(w, x, w_reg, x_reg, d, ks, tile, g, q, col, batch):
        if ks < n_steps:
            for u in T.unroll(unroll):
                k0: T.let[T.int32] = load_k(ks, u, q, step)
                if in_k(k0):
                    # rows past n and batch rows past the batch are clamped: they feed only
                    # accumulators that are never stored
                    for h in T.unroll(2 * mt):
                        for v in T.vectorized(VEC):
                            w_reg[d, u, h, v] = w[T.min(load_row(tile, h, g, mt), n - 1), k0 + v]
                    for v in T.vectorized(VEC):
                        x_reg[d, u, v] = x[T.min(col + g, batch - 1), k0 + v]
                else:
                    for h in T.unroll(2 * mt):
                        for v in T.vectorized(VEC):
                            w_reg[d, u, h, v] = T.Cast(DTYPE, 0)
                    for v in T.vectorized(VEC):
                        x_reg[d, u, v] = T.Cast(DTYPE, 0)

    @T.macro
    def product(w_reg, x_reg, a_frag, b_frag, acc, d, ks):
        if ks < n_steps:
            for u in T.unroll(unroll):
                for e in T.unroll(VEC):
                    b_frag[e] = x_reg[d, u, e]
                for m in T.unroll(mt):
                    for s in T.unroll(2):
                        for e in T.unroll(8):
                            h, v = T.meta_var(frag_source(m, s, e))
                            a_frag[m, s, e] = w_reg[d, u, h, v]
                for m in T.unroll(mt):
                    for s in T.unroll(2):
                        T.evaluate(
                            mma_bf16(a_frag.data, (m * 2 + s) * 8, b_frag.data, s * 4, acc.data,
                                     m * 4)
                        )  # fmt: skip

    @T.macro
    def accumulate_gpu(w, x, acc, wk, tile, tx, col, batch):
        w_reg = T.sblock_alloc_buffer((stages, unroll, 2 * mt, VEC), DTYPE, scope="local")
        x_reg = T.sblock_alloc_buffer((stages, unroll, VEC), DTYPE, scope="local")
        # mma operands are addressed by element offset: plain arrays the loads are copied into
        a_frag = T.sblock_alloc_buffer((mt, 2, 8), DTYPE, scope="local")
        b_frag = T.sblock_alloc_buffer((VEC,), DTYPE, scope="local")
        g, q = T.meta_var(lane_coords(tx))
        for d in T.unroll(stages):
            load(w, x, w_reg, x_reg, d, warp_step(d, wk, wks), tile, g, q, col, batch)
        # kept rolled: unrolled, ptxas hoists every step's loads and spills (255 registers)
        for it in T.serial(iters, annotations={"disable_unroll": 1}):
            for d in T.unroll(stages):
                product(w_reg, x_reg, a_frag, b_frag, acc, d, warp_step(it * stages + d, wk, wks))
                load(w, x, w_reg, x_reg, d, warp_step((it + 1) * stages + d, wk, wks), tile, g,
                     q, col, batch)  # fmt: skip

    @T.macro
    def accumulate_cpu(w, x, acc, wk, tile, tx, col, batch):
        # what the warp's mma leave in this lane's accumulators, computed from memory
        for j in T.serial(per_warp):
            ks: T.let[T.int32] = warp_step(j, wk, wks)
            if ks < n_steps:
                for m in T.serial(mt):
                    for e in T.serial(4):
                        er, ec = T.meta_var(acc_coords(tx, e))
                        row: T.let[T.int32] = T.min(tile * rb + m * 16 + er, n - 1)
                        b: T.let[T.int32] = T.min(col + ec, batch - 1)
                        for kk in T.serial(step):
                            if in_k(ks * step + kk):
                                acc[m * 4 + e] = acc[m * 4 + e] + T.Cast(
                                    "float32", w[row, ks * step + kk]
                                ) * T.Cast("float32", x[b, ks * step + kk])

    accumulate = accumulate_gpu if gpu else accumulate_cpu

    @T.macro
    def body(x, w, out, extras, batch):
        # batches past 8 take more blocks (a loop would let nvcc keep the first loads live)
        for p in passes(T.ceildiv(batch, COLS)):
            for tile in blocks(cdiv(n, rb)):
                with T.sblock("tile"):
                    T.reads()
                    T.writes()
                    if gpu:
                        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", min_blocks)
                    # each warp's partial sums, [warp, batch column, row of the tile]
                    part = T.sblock_alloc_buffer(
                        (wks, COLS, rb), "float32", scope="shared" if gpu else "global"
                    )
                    for wk in warps():
                        for tx in lanes():
                            with T.sblock("accumulate"):
                                T.reads()
                                T.writes()
                                acc = T.sblock_alloc_buffer((mt * 4,), "float32", scope="local")
                                for i in T.unroll(mt * 4):
                                    acc[i] = T.float32(0)
                                accumulate(w, x, acc, wk, tile, tx, p * COLS, batch)
                                for m in T.unroll(mt):
                                    for e in T.unroll(4):
                                        er, ec = T.meta_var(acc_coords(tx, e))
                                        part[wk, ec, m * 16 + er] = acc[m * 4 + e]
                    for wk in warps():
                        for tx in lanes():
                            with T.sblock("store"):
                                T.reads()
                                T.writes()
                                total = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                for i in T.unroll(store_iters):
                                    # consecutive threads take consecutive rows: coalesced
                                    o: T.let[T.int32] = i * cfg.threads + wk * 32 + tx
                                    r: T.let[T.int32] = o % rb
                                    row: T.let[T.int32] = tile * rb + r
                                    b: T.let[T.int32] = p * COLS + o // rb
                                    if o < outs and row < n and b < batch:
                                        total[0] = part[0, o // rb, r]
                                        for w2 in T.unroll(1, wks):
                                            total[0] = total[0] + part[w2, o // rb, r]
                                        out[b, row] = epilogue(total[0], b, row, extras)

    def extra_shape(i: int, m):
        return {"mn": (m, n), "n": (n,), "m": (m,)}[extra_shapes[i]]

    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True, KERNEL_ATTR: "gemv"}
    if not extra_shapes:

        @T.prim_func(s_tir=True)
        def gemv(x_h: T.handle, w_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            batch = T.int32()
            x = T.match_buffer(x_h, (batch, k), DTYPE)
            w = T.match_buffer(w_h, (n, k), DTYPE)
            out = T.match_buffer(o_h, (batch, n), out_dtype)
            body(x, w, out, (), batch)

    elif len(extra_shapes) == 1:

        @T.prim_func(s_tir=True)
        def gemv(x_h: T.handle, w_h: T.handle, e0_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            batch = T.int32()
            x = T.match_buffer(x_h, (batch, k), DTYPE)
            w = T.match_buffer(w_h, (n, k), DTYPE)
            e0 = T.match_buffer(e0_h, extra_shape(0, batch), extra_dtypes[0])
            out = T.match_buffer(o_h, (batch, n), out_dtype)
            body(x, w, out, (e0,), batch)

    else:

        @T.prim_func(s_tir=True)
        def gemv(x_h: T.handle, w_h: T.handle, e0_h: T.handle, e1_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            batch = T.int32()
            x = T.match_buffer(x_h, (batch, k), DTYPE)
            w = T.match_buffer(w_h, (n, k), DTYPE)
            e0 = T.match_buffer(e0_h, extra_shape(0, batch), extra_dtypes[0])
            e1 = T.match_buffer(e1_h, extra_shape(1, batch), extra_dtypes[1])
            out = T.match_buffer(o_h, (batch, n), out_dtype)
            body(x, w, out, (e0, e1), batch)

    return gemv


def gemv_for(
    func: tirx.PrimFunc, target: Target, config: GemvConfig | None = None
) -> tirx.PrimFunc | None:
    """The GEMV standing in for the fused bf16 GEMM `func`, parameters in `func`'s order; None
    if `func` is not one this kernel covers."""
    match = match_gemm(func)
    if match is None or match.k % VEC:
        return None
    kernel = gemv_kernel(match.n, match.k, target, config, match.extra_shapes,
                         match.extra_dtypes, match.out_dtype, match.epilogue)  # fmt: skip
    # the kernel's own order is (X, W, *extras, out); put each where `func` has it
    order = [match.a_param, match.b_param, *match.extra_params, match.out_param]
    params = [None] * len(order)
    for kernel_pos, func_pos in enumerate(order):
        params[func_pos] = kernel.params[kernel_pos]
    out = tirx.PrimFunc(params, kernel.body, attrs=kernel.attrs)
    for key, value in (func.attrs or {}).items():
        if key not in kernel.attrs:
            out = out.with_attr(key, value)
    return out


class DecodeGemv(GPUScheduleRule):
    """dlight rule: the fused bf16 GEMMs the pipeline marked "small" (decode, 1-7 rows) become
    this GEMV on sm_80+; anything else (fp32 GEMMs, k not a multiple of 8) falls through."""

    def __init__(self, config: GemvConfig | None = None, rows: str = "small"):
        if config is not None:
            config.check()
        self.config = config
        self.rows = rows

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if target.kind.name != "cuda" or func.attrs is None:
            return None
        if func.attrs.get(ROWS_ATTR) != self.rows:
            return None
        arch = str(target.attrs.get("arch", ""))
        if not (arch.startswith("sm_") and arch[3:].isdigit() and int(arch[3:]) >= MIN_SM):
            return None
        kernel = gemv_for(func, target, self.config)
        return None if kernel is None else s_tir.Schedule(kernel)
