"""Decode's RMSNorms folded into the GEMVs they feed (schedules/gemv.py, `rms_eps`).

In a decode step each of a layer's two norms is a kernel of its own between two projections,
and its output is read only by the next projection. This pass rewrites

    h = rms_norm(x, weight)            (schedules/norm.py; identity reshapes around it)
    y = gemm(h, W, ...)                (a fused bf16 GEMM marked for decode's GEMV)

into one GEMV that reads x, sums its squares from the loads it makes anyway and applies the
weight and 1/rms itself; the norm, now unused, is dropped. Only decode's ("small") GEMMs: in
decode_wide's 64-row bucket the extra registers spill, and prefill's GEMMs stay tiled.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from ..schedules.gemm_match import match_gemm
from ..schedules.gemv_rule import gemv_for
from ..schedules.matmul import ROWS_ATTR, has_tensor_cores
from ..schedules.norm import EPS_ATTR

FUSED_ROWS = "small"
CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _callee(mod: tvm.IRModule, expr) -> tuple[str, tvm.tirx.PrimFunc] | None:
    """(name, PrimFunc) of a call_tir, else None."""
    if not (isinstance(expr, relax.Call) and expr.op.same_as(CALL_TIR)):
        return None
    gv = expr.args[0]
    func = mod[gv] if isinstance(gv, tvm.ir.GlobalVar) and gv in mod.functions else None
    return (gv.name_hint, func) if isinstance(func, tvm.tirx.PrimFunc) else None


def _same_shape(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = a.ty, b.ty
    return (
        isinstance(sa, relax.TensorType)
        and isinstance(sb, relax.TensorType)
        and sa.shape is not None
        and sb.shape is not None
        and tvm_ffi.structural_equal(sa.shape, sb.shape)
    )


@relax.expr_functor.mutator
class _FoldNorms(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        super().__init__(mod)
        self.mod_ = mod
        self.target = target
        self.kernels: dict[tuple[str, float], tvm.ir.GlobalVar] = {}

    def _norm_input(self, arg: relax.Expr) -> tuple[relax.Expr, relax.Expr, float] | None:
        """(x, weight, eps) if `arg` is an RMSNorm's output, through identity reshapes."""
        while isinstance(arg, relax.Var):
            bound = self.lookup_binding(arg)
            called = _callee(self.mod_, bound)
            if called is None:
                return None
            name, func = called
            tensors = list(bound.args[1].fields)
            if func.attrs is not None and EPS_ATTR in func.attrs:
                return tensors[0], tensors[1], float(func.attrs[EPS_ATTR])
            if not (name.startswith("reshape") and len(tensors) == 1):
                return None
            if not _same_shape(tensors[0], bound):
                return None
            arg = tensors[0]
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        called = _callee(self.mod_, call)
        if called is None:
            return call
        name, func = called
        if func.attrs is None or func.attrs.get(ROWS_ATTR) != FUSED_ROWS:
            return call
        match = match_gemm(func)
        args = list(call.args[1].fields)
        norm = None if match is None else self._norm_input(args[match.a_param])
        if norm is None:
            return call
        x, weight, eps = norm
        if not _same_shape(x, args[match.a_param]):
            return call
        key = (name, eps)
        if key not in self.kernels:
            kernel = gemv_for(func, self.target, rows=FUSED_ROWS, rms_eps=eps)
            if kernel is None:
                return call
            symbol = f"{name}_rms_norm"
            kernel = kernel.with_attr("global_symbol", symbol)
            self.kernels[key] = self.builder_.add_func(kernel, symbol)
        args[match.a_param] = x
        return relax.Call(
            CALL_TIR, [self.kernels[key], relax.Tuple([*args, weight])], call.attrs, call.ty_args
        )


def fold_norms_into_gemv(target: tvm.target.Target) -> tvm.transform.Pass:
    """The pass, for `target` (a no-op below sm_80, where decode's GEMMs are dlight's)."""

    @tvm.transform.module_pass(opt_level=0, name="FoldNormsIntoGemv")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not has_tensor_cores(target):
            return mod
        mutator = _FoldNorms(mod, target)
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gv, mutator.visit_expr(func))
        return relax.transform.DeadCodeElimination()(mutator.builder_.get())

    return _pass
