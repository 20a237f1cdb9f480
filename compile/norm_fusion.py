"""Decode's RMSNorms folded into the GEMVs they feed (schedules/gemv.py, `rms_eps`).

In a decode step each of a layer's two norms is a kernel of its own between two projections,
and its output is read only by the next projection. Conversion has already moved the norm's
weight into that projection's columns (compile/convert.py), so this pass rewrites

    h = rms_scale(x)                   (schedules/norm.py, no weight; identity reshapes around it)
    y = gemm(h, W, ...)                (a fused bf16 GEMM marked for decode's GEMV)

into one GEMV that reads x, sums its squares from the loads it makes anyway and applies 1/rms
itself; the norm, now unused, is dropped. Decode's ("small") GEMMs, and decode_wide's where
`FOLD_WIDE` says so; prefill's GEMMs stay tiled.

`GemvFolder` is shared with compile/swiglu_fusion.py, which folds the SwiGLU after decode's
gate_up GEMV into it (and that GEMV's norm with it).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from ..schedules.gemm_match import match_gemm
from ..schedules.gemv_rule import gemv_for
from ..schedules.matmul_config import ROWS_ATTR, has_tensor_cores
from ..schedules.norm import EPS_ATTR

FUSED_ROWS = "small"
# decode_wide's norms into its GEMVs too (8-64 rows): 64 kernels fewer a step. With the norm's
# weight in the multiply (session 10) its 64-row buckets spilled or lost warps and the fold was
# reverted; without it ptxas fits every 4B bucket at the same launch bounds, no spills
# (tests/test_gemv_kernel.py). H200: c16 TPOT 4.093 -> 4.022 ms, 269 -> 205 kernels a 16-row
# step (engine_s26.json, profile_step_s26w.json).
FOLD_WIDE = True
CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def callee(mod: tvm.IRModule, expr) -> tuple[str, tvm.tirx.PrimFunc] | None:
    """(name, PrimFunc) of a call_tir, else None."""
    if not (isinstance(expr, relax.Call) and expr.op.same_as(CALL_TIR)):
        return None
    gv = expr.args[0]
    func = mod[gv] if isinstance(gv, tvm.ir.GlobalVar) and gv in mod.functions else None
    return (gv.name_hint, func) if isinstance(func, tvm.tirx.PrimFunc) else None


def same_shape(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = a.ty, b.ty
    return (
        isinstance(sa, relax.TensorType)
        and isinstance(sb, relax.TensorType)
        and sa.shape is not None
        and sb.shape is not None
        and tvm_ffi.structural_equal(sa.shape, sb.shape)
    )


def decode_gemm(func: tvm.tirx.PrimFunc, rows: str = FUSED_ROWS):
    """gemm_match's GemmMatch of a fused GEMM marked for `rows`' GEMV, else None."""
    if func.attrs is None or func.attrs.get(ROWS_ATTR) != rows:
        return None
    return match_gemm(func)


class GemvFolder(relax.PyExprMutator):
    """A mutator (decorate subclasses with relax.expr_functor.mutator) that turns a decode
    GEMM's call_tir into one of our GEMV with the GEMM's neighbours folded in (`gemv_call`)."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        super().__init__(mod)
        self.mod_ = mod
        self.target = target
        # (GEMM name, eps, SwiGLU): a GEMM's name already says its rows (the pipeline splits
        # GEMMs by rows)
        self.kernels: dict[tuple[str, float | None, bool], tvm.ir.GlobalVar] = {}

    def producer(self, arg: relax.Expr) -> tuple[relax.Var, relax.Call, tvm.tirx.PrimFunc]:
        """(the var it binds, the call_tir, its PrimFunc) that computes `arg`, through identity
        reshapes (`arg` itself where it is no call_tir's output; the call then None)."""
        while isinstance(arg, relax.Var):
            bound = self.lookup_binding(arg)
            called = callee(self.mod_, bound)
            if called is None:
                break
            name, func = called
            tensors = list(bound.args[1].fields)
            reshape = name.startswith("reshape") and len(tensors) == 1
            if not (reshape and same_shape(tensors[0], bound)):
                return arg, bound, func
            arg = tensors[0]
        return arg, None, None

    def _norm_input(self, arg: relax.Expr) -> tuple[relax.Expr, float] | None:
        """(x, eps) if `arg` is the output of an RMSNorm without weight, through identity
        reshapes (a norm with a weight is not folded: the GEMV applies none)."""
        _, call, func = self.producer(arg)
        if call is None or func.attrs is None or EPS_ATTR not in func.attrs:
            return None
        tensors = list(call.args[1].fields)
        return (tensors[0], float(func.attrs[EPS_ATTR])) if len(tensors) == 1 else None

    def gemv_call(
        self, call: relax.Call, swiglu_ty=None, rows: str = FUSED_ROWS, fold_norm: bool = True
    ) -> relax.Call | None:
        """`call`, a `rows` GEMM's call_tir, as a call of our GEMV with the RMSNorm folded in
        where the GEMM's A is a norm's output (unless not `fold_norm`), and with `swiglu_ty`
        (the SwiGLU's out type) the SwiGLU after it. None where there is nothing to fold or
        the kernel cannot."""
        name, func = callee(self.mod_, call)
        match = decode_gemm(func, rows)
        if match is None:
            return None
        args = list(call.args[1].fields)
        norm = self._norm_input(args[match.a_param]) if fold_norm else None
        if norm is not None and not same_shape(norm[0], args[match.a_param]):
            norm = None
        swiglu = swiglu_ty is not None
        if norm is None and not swiglu:
            return None
        eps = None if norm is None else norm[1]
        key = (name, eps, swiglu)
        if key not in self.kernels:
            kernel = gemv_for(func, self.target, rows=rows, rms_eps=eps, swiglu=swiglu)
            if kernel is None:
                return None
            symbol = name + ("_rms_norm" if norm else "") + ("_swiglu" if swiglu else "")
            kernel = kernel.with_attr("global_symbol", symbol)
            self.kernels[key] = self.builder_.add_func(kernel, symbol)
        if norm is not None:
            args[match.a_param] = norm[0]
        out_ty = [swiglu_ty] if swiglu else call.ty_args
        return relax.Call(CALL_TIR, [self.kernels[key], relax.Tuple(args)], call.attrs, out_ty)

    def begin(self, func: relax.Function) -> None:
        """Called before each Relax function is visited."""

    def fold_module(self) -> tvm.IRModule:
        """Every Relax function visited, unused bindings dropped."""
        for gv, func in list(self.mod_.functions_items()):
            if isinstance(func, relax.Function):
                self.begin(func)
                self.builder_.update_func(gv, self.visit_expr(func))
        return relax.transform.DeadCodeElimination()(self.builder_.get())


@relax.expr_functor.mutator
class NormFolder(GemvFolder):
    """The pass's mutator: each decode GEMM fed by a norm (`fold_module()` for a module)."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if callee(self.mod_, call) is None:
            return call
        folded = self.gemv_call(call)
        if folded is None and FOLD_WIDE:
            folded = self.gemv_call(call, rows="wide")
        return call if folded is None else folded


def gemv_fold_pass(name: str, folder: type[GemvFolder], target) -> tvm.transform.Pass:
    """The module pass running `folder` for `target` (a no-op below sm_80, where decode's
    GEMMs are dlight's)."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return folder(mod, target).fold_module() if has_tensor_cores(target) else mod

    return _pass


def fold_norms_into_gemv(target: tvm.target.Target) -> tvm.transform.Pass:
    """The pass, for `target`."""
    return gemv_fold_pass("FoldNormsIntoGemv", NormFolder, target)
