"""Tensor-core GEMM for the bf16 projections of prefill: C = epilogue(A · Bᵀ), A [m, k] bf16 with
m symbolic, B [n, k] bf16 (the weight as stored, k contiguous), fp32 accumulation on
mma.sync m16n8k16, then whatever elementwise epilogue FuseOps put behind the matmul (the cast to
bf16, a residual add, ...), evaluated on the accumulator in registers.

Why our own kernel: dlight's tensor-core path (`gpu.Matmul` -> `MatmulTensorization`) needs
`Schedule.tensorize`, which deep-copies the intrinsic through TVM's JSON serializer, and with the
installed apache-tvm-ffi (0.1.15) that serializer segfaults on any node with a dtype field
(`tvm.ir.save_json(tvm.tirx.IntImm("int32", 3))` is enough); apache-tvm 0.27.0.post1 works with
apache-tvm-ffi 0.1.14.post0. TVM's mma/wmma intrinsics are fp16/int8-only anyway. So, like
schedules/logits.py, this kernel is plain TIR with the PTX instructions written out, and it
replaces the fused PrimFunc whole (`MatmulMMA` below, a dlight rule).

Kernel: a thread block computes a block_m x block_n tile of C with warps_m x warps_n warps, each
owning a (block_m / warps_m) x (block_n / warps_n) sub-tile. k is consumed block_k at a time
through a `stages`-deep ring of shared-memory tiles filled by cp.async (16-byte chunks, each
tile row's chunks XOR-swizzled so ldmatrix and the copies are bank-conflict free); ldmatrix.x4
moves 16x16 A and 16(n)x16(k) B fragments to registers, mma.sync accumulates in fp32. Rows of A
past m (and of B past n) are clamped to the last row: they only feed accumulator rows (columns)
that are never stored. The grid runs m tiles fastest, so the blocks in flight share weight tiles
through L2 and the weight is streamed from DRAM about once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm_ffi
from tvm import ir, s_tir, tirx
from tvm.ir.prim import expr as pe
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.script import tirx as T
from tvm.target import Target

from .ptx import mma_bf16

DTYPE = "bfloat16"
# Set on fused GEMM PrimFuncs by the pipeline: "large" (prefill: this kernel) or "small" (decode:
# dlight's GEMV rules). Prefill and decode share PrimFuncs until the pipeline splits them.
ROWS_ATTR = "qwen35.gemm_rows"
MAX_EXTRA_INPUTS = 2  # epilogue inputs besides A and B (a residual, a bias, ...)
# Flat element offsets stay int32: m * max(n, k) must stay below 2**31 (m <= 116k at n = 18432).
MIN_SM = 80  # cp.async, ldmatrix and bf16 mma.sync


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 3

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * 32

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.block_m + self.block_n) * self.block_k * 2

    def check(self) -> None:
        """Raise ValueError if the tiling cannot be built."""
        warp_m, warp_n = self.block_m // self.warps_m, self.block_n // self.warps_n
        if self.block_k not in (32, 64):
            raise ValueError(f"block_k {self.block_k}: 32 or 64")
        if warp_m % 16 or warp_n % 16 or warp_m * self.warps_m != self.block_m:
            raise ValueError(f"warp tile {warp_m}x{warp_n}: multiples of 16 that tile the block")
        if warp_n * self.warps_n != self.block_n or self.stages < 2:
            raise ValueError(f"{self}: warps must tile block_n; stages >= 2")
        chunks = (self.block_m + self.block_n) * self.block_k // 8
        if chunks % self.threads or self.block_m * self.block_k // 8 % self.threads:
            raise ValueError(f"{self}: tile copies must split evenly over the threads")


DEFAULT_CONFIG = GemmConfig()
# Decode batches of 8-64 rows: a 64-row tile, deeper k steps (0.9x cuBLAS at m = 16 on an H200,
# where the GEMV rules reach 0.33x).
WIDE_DECODE_CONFIG = GemmConfig(block_m=64, block_k=64, stages=4)

# ---- layout: shared by the kernel (with TIR expressions) and the test's emulator (with ints) ----

Index = int | tirx.Expr


def tile_offset(row: Index, chunk: Index, chunks: int) -> Index:
    """Element offset of 16-byte chunk `chunk` of row `row` in a tile whose rows hold `chunks`
    chunks. The chunk index is XORed with the row's place among the rows sharing a 128-byte bank
    window, so the 8 rows an ldmatrix reads (and a warp's 32 copies) hit 8 different banks."""
    rows_per_window = 8 // chunks
    return row * (chunks * 8) + (chunk ^ (row // rows_per_window % chunks)) * 8


def copy_coords(index: Index, chunks: int) -> tuple[Index, Index]:
    """(row, chunk) of the index-th 16-byte chunk of a tile; consecutive threads take
    consecutive chunks of a row, so a warp reads whole rows of global memory."""
    return index // chunks, index % chunks


def ldmatrix_a_coords(lane: Index, kk: Index) -> tuple[Index, Index]:
    """(row, chunk) whose address `lane` gives ldmatrix.x4 for the A fragment of one m16 x k16
    step kk: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
    k 8-15), which are mma's a0a1, a2a3, a4a5, a6a7 registers."""
    return lane % 16, kk * 2 + lane // 16


def ldmatrix_b_coords(lane: Index, kk: Index) -> tuple[Index, Index]:
    """(row of B = column n, chunk) for ldmatrix.x4 of two n8 x k16 B fragments: matrices
    (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15), i.e. b0b1 and b2b3 of
    the first n8 tile, then of the second."""
    return lane // 16 * 8 + lane % 8, kk * 2 + lane // 8 % 2


def acc_coords(lane: Index, e: Index) -> tuple[Index, Index]:
    """(row, column) within an m16 x n8 tile of accumulator element e (0..3) of `lane`."""
    return lane // 4 + e // 2 * 8, lane % 4 * 2 + e % 2


# ---- the kernel ----------------------------------------------------------------------------

Epilogue = Callable[..., tirx.Expr]  # (acc value, row, col, extra buffers) -> stored value


def _plain_epilogue(acc, _row, _col, _extras):
    return acc


def gemm_kernel(
    n: int,
    k: int,
    config: GemmConfig = DEFAULT_CONFIG,
    extra_shapes: tuple[str, ...] = (),
    extra_dtypes: tuple[str, ...] = (),
    out_dtype: str = "float32",
    epilogue: Epilogue = _plain_epilogue,
) -> tirx.PrimFunc:
    """The kernel with parameters (A [m, k], B [n, k], *extras, out [m, n]); each extra input
    is indexed [m, n], [n] or [m] (`extra_shapes` "mn", "n", "m"). `epilogue(acc, row, col,
    extras)` gives the value stored at out[row, col] from the fp32 accumulator."""
    config.check()
    if k % config.block_k:
        raise ValueError(f"k {k} must be a multiple of block_k {config.block_k}")
    if len(extra_shapes) > MAX_EXTRA_INPUTS or len(extra_shapes) != len(extra_dtypes):
        raise ValueError(f"at most {MAX_EXTRA_INPUTS} extra inputs, each with a dtype")
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.stages
    wn_count, threads = config.warps_n, config.threads
    warp_m, warp_n = bm // config.warps_m, bn // config.warps_n
    mt_count, nt_count = warp_m // 16, warp_n // 8  # m16 and n8 tiles per warp
    ksteps = bk // 16
    chunks = bk // 8
    a_copies, b_copies = bm * chunks // threads, bn * chunks // threads
    k_tiles, n_tiles = k // bk, -(-n // bn)
    scope = "shared" if config.shared_bytes <= 48 * 1024 else "shared.dyn"

    def extra_shape(i: int, m):
        return {"mn": (m, n), "n": (n,), "m": (m,)}[extra_shapes[i]]

    @T.macro
    def load_tile(a, b, a_sh, b_sh, stage, kt, bx, by, tid, m):
        # rows past m / n are clamped: they feed only accumulators that are never stored
        for it in T.unroll(a_copies):
            row, chunk = T.meta_var(copy_coords(it * threads + tid, chunks))
            T.evaluate(
                T.s_tir.cp_async_raw.legacy(
                    a_sh.data,
                    stage * bm * bk + tile_offset(row, chunk, chunks),
                    a.data,
                    T.min(bx * bm + row, m - 1) * k + kt * bk + chunk * 8,
                    16,
                    dtype=DTYPE,
                )
            )
        for it in T.unroll(b_copies):
            row, chunk = T.meta_var(copy_coords(it * threads + tid, chunks))
            T.evaluate(
                T.s_tir.cp_async_raw.legacy(
                    b_sh.data,
                    stage * bn * bk + tile_offset(row, chunk, chunks),
                    b.data,
                    T.min(by * bn + row, n - 1) * k + kt * bk + chunk * 8,
                    16,
                    dtype=DTYPE,
                )
            )

    @T.macro
    def body(a, b, out, extras, m):
        for bx in T.thread_binding(T.ceildiv(m, bm), thread="blockIdx.x"):
            for by in T.thread_binding(n_tiles, thread="blockIdx.y"):
                for ty in T.thread_binding(threads // 32, thread="threadIdx.y"):
                    for tx in T.thread_binding(32, thread="threadIdx.x"):
                        with T.sblock("gemm"):
                            T.reads()
                            T.writes()
                            a_sh = T.sblock_alloc_buffer((stages * bm * bk,), DTYPE, scope=scope)
                            b_sh = T.sblock_alloc_buffer((stages * bn * bk,), DTYPE, scope=scope)
                            # one fragment set per k16 step, so the next step's ldmatrix can be
                            # issued while this step's mma run
                            a_frag = T.sblock_alloc_buffer(
                                (ksteps * mt_count * 8,), DTYPE, scope="local"
                            )
                            b_frag = T.sblock_alloc_buffer(
                                (ksteps * nt_count * 4,), DTYPE, scope="local"
                            )
                            acc = T.sblock_alloc_buffer(
                                (mt_count * nt_count * 4,), "float32", scope="local"
                            )
                            tid: T.let[T.int32] = ty * 32 + tx
                            row_w: T.let[T.int32] = ty // wn_count * warp_m
                            col_w: T.let[T.int32] = ty % wn_count * warp_n
                            for i in T.unroll(mt_count * nt_count * 4):
                                acc[i] = T.float32(0)
                            for s in T.unroll(stages - 1):
                                if s < k_tiles:
                                    load_tile(a, b, a_sh, b_sh, s, s, bx, by, tid, m)
                                T.evaluate(T.ptx["cp.async.commit_group"]())
                            for kt in T.serial(k_tiles):
                                # tile kt has landed once at most stages - 2 groups are pending;
                                # the barrier also retires the stage the next copy overwrites
                                T.evaluate(T.ptx["cp.async.wait_group"](stages - 2))
                                T.tvm_storage_sync("shared")
                                if kt + stages - 1 < k_tiles:
                                    load_tile(
                                        a,
                                        b,
                                        a_sh,
                                        b_sh,
                                        (kt + stages - 1) % stages,
                                        kt + stages - 1,
                                        bx,
                                        by,
                                        tid,
                                        m,
                                    )
                                T.evaluate(T.ptx["cp.async.commit_group"]())
                                stage: T.let[T.int32] = kt % stages
                                for kk in T.unroll(ksteps):
                                    for mt in T.unroll(mt_count):
                                        ar, ac = T.meta_var(ldmatrix_a_coords(tx, kk))
                                        T.evaluate(
                                            T.ptx_legacy.ldmatrix(
                                                False,
                                                4,
                                                ".b16",
                                                a_frag.data,
                                                (kk * mt_count + mt) * 8,
                                                a_sh.access_ptr("r"),
                                                stage * bm * bk
                                                + tile_offset(row_w + mt * 16 + ar, ac, chunks),
                                                dtype=DTYPE,
                                            )
                                        )
                                    for np in T.unroll(nt_count // 2):
                                        br, bc = T.meta_var(ldmatrix_b_coords(tx, kk))
                                        T.evaluate(
                                            T.ptx_legacy.ldmatrix(
                                                False,
                                                4,
                                                ".b16",
                                                b_frag.data,
                                                (kk * nt_count + np * 2) * 4,
                                                b_sh.access_ptr("r"),
                                                stage * bn * bk
                                                + tile_offset(col_w + np * 16 + br, bc, chunks),
                                                dtype=DTYPE,
                                            )
                                        )
                                    for mt in T.unroll(mt_count):
                                        for nt in T.unroll(nt_count):
                                            T.evaluate(
                                                mma_bf16(
                                                    a_frag.data,
                                                    (kk * mt_count + mt) * 8,
                                                    b_frag.data,
                                                    (kk * nt_count + nt) * 4,
                                                    acc.data,
                                                    (mt * nt_count + nt) * 4,
                                                )
                                            )
                            for mt in T.unroll(mt_count):
                                for nt in T.unroll(nt_count):
                                    for e in T.unroll(4):
                                        er, ec = T.meta_var(acc_coords(tx, e))
                                        r: T.let[T.int32] = bx * bm + row_w + mt * 16 + er
                                        c: T.let[T.int32] = by * bn + col_w + nt * 8 + ec
                                        if r < m and c < n:
                                            out[r, c] = epilogue(
                                                acc[(mt * nt_count + nt) * 4 + e], r, c, extras
                                            )

    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True}
    if not extra_shapes:

        @T.prim_func(s_tir=True)
        def gemm(a_h: T.handle, b_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            m = T.int32()
            a = T.match_buffer(a_h, (m, k), DTYPE)
            b = T.match_buffer(b_h, (n, k), DTYPE)
            out = T.match_buffer(o_h, (m, n), out_dtype)
            body(a, b, out, (), m)

    elif len(extra_shapes) == 1:

        @T.prim_func(s_tir=True)
        def gemm(a_h: T.handle, b_h: T.handle, e0_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            m = T.int32()
            a = T.match_buffer(a_h, (m, k), DTYPE)
            b = T.match_buffer(b_h, (n, k), DTYPE)
            e0 = T.match_buffer(e0_h, extra_shape(0, m), extra_dtypes[0])
            out = T.match_buffer(o_h, (m, n), out_dtype)
            body(a, b, out, (e0,), m)

    else:

        @T.prim_func(s_tir=True)
        def gemm(a_h: T.handle, b_h: T.handle, e0_h: T.handle, e1_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            m = T.int32()
            a = T.match_buffer(a_h, (m, k), DTYPE)
            b = T.match_buffer(b_h, (n, k), DTYPE)
            e0 = T.match_buffer(e0_h, extra_shape(0, m), extra_dtypes[0])
            e1 = T.match_buffer(e1_h, extra_shape(1, m), extra_dtypes[1])
            out = T.match_buffer(o_h, (m, n), out_dtype)
            body(a, b, out, (e0, e1), m)

    return gemm


# ---- recognising the fused GEMM --------------------------------------------------------------


class _NoMatch(Exception):
    pass


def _require(cond: bool) -> None:
    if not cond:
        raise _NoMatch


def _is(a, b) -> bool:
    return isinstance(a, ir.Expr) and a.same_as(b)


def _int(e) -> int | None:
    return int(e.value) if isinstance(e, pe.IntImm) else None


def _same_dim(x, y) -> bool:
    return _int(x) == y if isinstance(y, int) else tvm_ffi.structural_equal(x, y)


@dataclass(frozen=True)
class GemmMatch:
    """A fused PrimFunc recognised as out = epilogue(A · Bᵀ)."""

    n: int
    k: int
    a_param: int  # positions in the function's parameter list
    b_param: int
    out_param: int
    extra_params: tuple[int, ...]
    extra_shapes: tuple[str, ...]
    extra_dtypes: tuple[str, ...]
    out_dtype: str
    epilogue: Epilogue


_BINARY = (pe.Add, pe.Sub, pe.Mul, pe.Div, pe.Min, pe.Max)


def _epilogue_of(value, acc, i, j, extras: list) -> Epilogue:
    """Turn the final block's stored value into a builder over (acc, row, col, extra buffers):
    acc[i, j] becomes the accumulator; other loads must be of parameters at [i, j], [j] or [i];
    only a whitelist of pure elementwise nodes is accepted."""

    def check(e) -> None:
        if isinstance(e, ir.TensorLoad):
            idx = list(e.indices)
            if _is(e.source, acc):
                _require(len(idx) == 2 and _is(idx[0], i) and _is(idx[1], j))
                return
            if len(idx) == 2 and _is(idx[0], i) and _is(idx[1], j):
                kind = "mn"
            elif len(idx) == 1 and (_is(idx[0], i) or _is(idx[0], j)):
                kind = "m" if _is(idx[0], i) else "n"
            else:
                raise _NoMatch
            known = [kd for src, kd in extras if src.same_as(e.source)]
            _require(not known or known[0] == kind)
            if not known:
                extras.append((e.source, kind))
        elif isinstance(e, pe.Cast):
            check(e.value)
        elif isinstance(e, _BINARY):
            check(e.a)
            check(e.b)
        elif isinstance(e, ir.Call):
            _require(e.attrs is None and isinstance(e.op, ir.Op))
            for x in e.args:
                check(x)
        else:
            _require(isinstance(e, (pe.FloatImm, pe.IntImm)))

    check(value)
    sources = [src for src, _ in extras]

    def build(acc_value, row, col, bufs):
        def go(e):
            if isinstance(e, ir.TensorLoad):
                if _is(e.source, acc):
                    return acc_value
                buf = bufs[next(n for n, s in enumerate(sources) if s.same_as(e.source))]
                idx = [row if _is(x, i) else col for x in e.indices]
                return buf[tuple(idx)]
            if isinstance(e, pe.Cast):
                return pe.Cast(str(e.ty), go(e.value))
            if isinstance(e, _BINARY):
                return type(e)(go(e.a), go(e.b))
            if isinstance(e, ir.Call):
                return ir.Call(e.op, [go(x) for x in e.args], ret_ty=e.ty)
            return e

        return go(value)

    return build


def match_gemm(func: tirx.PrimFunc, dtypes: tuple[str, ...] = (DTYPE,)) -> GemmMatch | None:
    """Recognise C[i, j] = sum_k f32(A[i, k]) * f32(B[j, k]) over parameters A [m, k] and
    B [n, k] (n, k constant) of one of `dtypes`, followed by elementwise blocks ending in one
    store of a [m, n] parameter; None for anything else (the dlight rules then take it)."""
    if not isinstance(func, tirx.PrimFunc):
        return None
    try:
        return _match(func, dtypes)
    except _NoMatch:
        return None
    except Exception:  # noqa: BLE001  s_tir raises many kinds for what it cannot inline
        return None


def _operand(e):
    """A load, possibly cast to fp32 (the cast is absent when it is fp32 already)."""
    if isinstance(e, pe.Cast):
        _require(str(e.ty) == "float32")
        e = e.value
    _require(isinstance(e, ir.TensorLoad))
    return e


def _match(func: tirx.PrimFunc, dtypes: tuple[str, ...]) -> GemmMatch:
    sch = s_tir.Schedule(func)
    params = list(sch.mod["main"].params)

    def param_index(buf) -> int:
        pos = [n for n, p in enumerate(params) if p.same_as(buf)]
        _require(len(pos) == 1)
        return pos[0]

    root = sch.get_sblock(sch.mod["main"].body.block.name_hint)
    blocks = list(sch.get_child_blocks(root))
    _require(len(blocks) >= 1)
    red = sch.get(blocks[0])
    _require(len(red.iter_vars) == 3 and red.init is not None)
    kinds = [iv.iter_type for iv in red.iter_vars]
    _require(kinds == [tirx.IterVar.DataPar, tirx.IterVar.DataPar, tirx.IterVar.CommReduce])
    i, j, kv = (iv.var for iv in red.iter_vars)
    store, init = red.body, red.init
    _require(isinstance(store, tirx.BufferStore) and isinstance(init, tirx.BufferStore))
    acc = store.buffer
    _require(str(acc.dtype) == "float32")
    _require(_is(init.buffer, acc) and isinstance(init.value, pe.FloatImm))
    _require(float(init.value.value) == 0.0)
    _require([_is(x, v) for x, v in zip(store.indices, (i, j), strict=False)] == [True, True])
    v = store.value
    _require(isinstance(v, pe.Add) and isinstance(v.a, ir.TensorLoad) and _is(v.a.source, acc))
    _require(isinstance(v.b, pe.Mul))
    la, lb = _operand(v.b.a), _operand(v.b.b)
    _require(_is(la.indices[0], i) and _is(la.indices[1], kv) and len(la.indices) == 2)
    _require(_is(lb.indices[0], j) and _is(lb.indices[1], kv) and len(lb.indices) == 2)
    a, b = la.source, lb.source
    a_param, b_param = param_index(a), param_index(b)
    _require(str(a.dtype) in dtypes and str(b.dtype) == str(a.dtype))
    n, k = _int(b.shape[0]), _int(b.shape[1])
    _require(n is not None and k is not None and _int(a.shape[1]) == k)
    m = a.shape[0]
    _require(isinstance(m, tirx.Var) or _int(m) is not None)
    extents = [iv.dom.extent for iv in red.iter_vars]
    _require(_same_dim(extents[0], m) and _int(extents[1]) == n)
    _require(_int(extents[2]) == k)

    if len(blocks) == 1:
        # no epilogue: the reduction writes the fp32 output parameter itself
        return GemmMatch(n, k, a_param, b_param, param_index(acc), (), (), (), "float32",
                         _plain_epilogue)  # fmt: skip
    for blk in blocks[1:-1]:
        sch.compute_inline(blk)  # raises (-> no match) if an intermediate is also an output
    last = sch.get(blocks[-1])
    _require(len(last.iter_vars) == 2 and last.init is None)
    _require(all(iv.iter_type == tirx.IterVar.DataPar for iv in last.iter_vars))
    li, lj = (iv.var for iv in last.iter_vars)
    _require(_same_dim(last.iter_vars[0].dom.extent, m))
    _require(_int(last.iter_vars[1].dom.extent) == n)
    out = last.body
    _require(isinstance(out, tirx.BufferStore) and len(out.indices) == 2)
    _require(_is(out.indices[0], li) and _is(out.indices[1], lj))
    out_param = param_index(out.buffer)
    _require(_same_dim(out.buffer.shape[0], m) and _int(out.buffer.shape[1]) == n)
    extras: list = []
    epilogue = _epilogue_of(out.value, acc, li, lj, extras)
    _require(len(extras) <= MAX_EXTRA_INPUTS)
    for src, kind in extras:
        want = {"mn": (m, n), "n": (n,), "m": (m,)}[kind]
        _require(len(src.shape) == len(want))
        _require(all(_same_dim(x, y) for x, y in zip(src.shape, want, strict=True)))
    extra_params = tuple(param_index(src) for src, _ in extras)
    used = {a_param, b_param, out_param, *extra_params}
    _require(len(used) == 3 + len(extras) == len(params))
    return GemmMatch(
        n=n,
        k=k,
        a_param=a_param,
        b_param=b_param,
        out_param=out_param,
        extra_params=extra_params,
        extra_shapes=tuple(kind for _, kind in extras),
        extra_dtypes=tuple(str(src.dtype) for src, _ in extras),
        out_dtype=str(out.buffer.dtype),
        epilogue=epilogue,
    )


def gemm_for(func: tirx.PrimFunc, config: GemmConfig = DEFAULT_CONFIG) -> tirx.PrimFunc | None:
    """The tensor-core kernel standing in for `func`, parameters in `func`'s order; None if
    `func` is not a fused bf16 GEMM this kernel covers."""
    match = match_gemm(func)
    if match is None or match.k % config.block_k:
        return None
    kernel = gemm_kernel(
        match.n,
        match.k,
        config,
        match.extra_shapes,
        match.extra_dtypes,
        match.out_dtype,
        match.epilogue,
    )
    # the kernel's own order is (A, B, *extras, out); put each where `func` has it
    order = [match.a_param, match.b_param, *match.extra_params, match.out_param]
    params = [None] * len(order)
    for kernel_pos, func_pos in enumerate(order):
        params[func_pos] = kernel.params[kernel_pos]
    out = tirx.PrimFunc(params, kernel.body, attrs=kernel.attrs)
    for key, value in (func.attrs or {}).items():
        if key not in kernel.attrs:
            out = out.with_attr(key, value)
    return out


class MatmulMMA(GPUScheduleRule):
    """dlight rule: the fused bf16 GEMMs the pipeline marked with `rows` ("large": prefill,
    "wide": wide decode) become the tensor-core kernel on sm_80+; everything else falls through
    to the next rule."""

    def __init__(self, config: GemmConfig = DEFAULT_CONFIG, rows: str = "large"):
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
        kernel = gemm_for(func, self.config)
        return None if kernel is None else s_tir.Schedule(kernel)
