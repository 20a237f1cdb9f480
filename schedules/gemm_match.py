"""Recognising a fused bf16 GEMM PrimFunc (what FuseOps/FuseTIR make of `Linear` plus its
elementwise epilogue) so that schedules/matmul.py can replace it with the tensor-core kernel:
which parameters are A, B, the extra epilogue inputs and the output, the shapes, and the
epilogue rebuilt as a function of the fp32 accumulator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm_ffi
from tvm import ir, s_tir, tirx
from tvm.ir.prim import expr as pe
from tvm.script import tirx as T

DTYPE = "bfloat16"
MAX_EXTRA_INPUTS = 2  # epilogue inputs besides A and B (a residual, a bias, ...)

Epilogue = Callable[..., tirx.Expr]  # (acc value, row, col, extra buffers) -> stored value


def plain_epilogue(acc, _row, _col, _extras):
    return acc


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
                         plain_epilogue)  # fmt: skip
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


# ---- declaring a kernel with the fused GEMM's parameters ---------------------------------------


def fused_gemm_func(
    name: str,
    body,
    n: int,
    k: int,
    extra_shapes: tuple[str, ...],
    extra_dtypes: tuple[str, ...],
    out_dtype: str,
    attrs: dict,
    out_n: int | None = None,
) -> tirx.PrimFunc:
    """The PrimFunc `name` (A [m, k], B [n, k] bf16, *extras, out [m, out_n or n] `out_dtype`),
    m symbolic, whose body is the macro `body(a, b, out, extras, m)`. Extras are indexed [m, n],
    [n] or [m] (`extra_shapes` "mn", "n", "m"), at most MAX_EXTRA_INPUTS of them."""
    cols = out_n or n
    if len(extra_shapes) > MAX_EXTRA_INPUTS or len(extra_shapes) != len(extra_dtypes):
        raise ValueError(f"at most {MAX_EXTRA_INPUTS} extra inputs, each with a dtype")

    def extra_shape(i: int, m):
        return {"mn": (m, n), "n": (n,), "m": (m,)}[extra_shapes[i]]

    if not extra_shapes:

        @T.prim_func(s_tir=True)
        def fused(a_h: T.handle, b_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            m = T.int32()
            a = T.match_buffer(a_h, (m, k), DTYPE)
            b = T.match_buffer(b_h, (n, k), DTYPE)
            out = T.match_buffer(o_h, (m, cols), out_dtype)
            body(a, b, out, (), m)

    elif len(extra_shapes) == 1:

        @T.prim_func(s_tir=True)
        def fused(a_h: T.handle, b_h: T.handle, e0_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            m = T.int32()
            a = T.match_buffer(a_h, (m, k), DTYPE)
            b = T.match_buffer(b_h, (n, k), DTYPE)
            e0 = T.match_buffer(e0_h, extra_shape(0, m), extra_dtypes[0])
            out = T.match_buffer(o_h, (m, cols), out_dtype)
            body(a, b, out, (e0,), m)

    else:

        @T.prim_func(s_tir=True)
        def fused(a_h: T.handle, b_h: T.handle, e0_h: T.handle, e1_h: T.handle, o_h: T.handle):
            T.func_attr(attrs)
            m = T.int32()
            a = T.match_buffer(a_h, (m, k), DTYPE)
            b = T.match_buffer(b_h, (n, k), DTYPE)
            e0 = T.match_buffer(e0_h, extra_shape(0, m), extra_dtypes[0])
            e1 = T.match_buffer(e1_h, extra_shape(1, m), extra_dtypes[1])
            out = T.match_buffer(o_h, (m, cols), out_dtype)
            body(a, b, out, (e0, e1), m)

    return fused.with_attr("global_symbol", name)


def by_rows(limit: int, few, many):
    """A macro (a, b, out, extras, rows) of a GEMM's launches: `few`'s up to `limit` rows,
    `many`'s beyond, chosen on the host."""

    @T.macro
    def pick(a, b, out, extras, rows):
        if rows <= limit:
            few(a, b, out, extras, rows)
        else:
            many(a, b, out, extras, rows)

    return pick
