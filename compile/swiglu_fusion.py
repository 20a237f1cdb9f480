"""Decode's SwiGLU folded into the gate_up GEMV before it (schedules/gemv.py, `swiglu`).

Each MLP of a decode step runs gate_up = GEMV(x, W [2 I, H]), then the SwiGLU kernel
(schedules/activation.py: silu(gate_up[:, j]) · gate_up[:, I + j]), then the down projection.
This pass rewrites

    gu = gemm(x, W_gate_up, ...)       (a fused bf16 GEMM marked for decode's GEMV)
    a = swiglu(gu)                     (identity reshapes between them)

into one GEMV whose blocks take both gate row j and up row I + j of the weight as stored and
store silu(gate) · up: gate_up never reaches memory and the SwiGLU's launch goes. Where x is
an RMSNorm's output, the norm is folded in too (compile/norm_fusion.py's GemvFolder), so this
pass runs before fold_norms_into_gemv, which takes the other GEMMs. A gate_up read by anything
else stays as it is.

Prefill's gate_up GEMM ("large") can take its SwiGLU too, as the tensor-core GEMM's epilogue
(`PREFILL_GEMM_SWIGLU`). decode_wide's gate_up takes its SwiGLU (`WIDE_SWIGLU`), and its norm
with it where norm_fusion.FOLD_WIDE says so; ptxas fits both folds, no spills (the norm has no
weight to multiply in: compile/convert.py).
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..schedules.activation import INTER_ATTR
from ..schedules.gemm_match import match_gemm
from ..schedules.matmul_config import ROWS_ATTR
from ..schedules.matmul_rule import gemm_for
from . import norm_fusion
from .norm_fusion import CALL_TIR, GemvFolder, callee, gemv_fold_pass

# Prefill's SwiGLU into its gate_up GEMM (schedules/matmul.py `swiglu`). On the H200
# (docs/results/gemm_kernel_swiglu_sweep.json) the fused 4B gate_up runs at 0.87x/0.86x cuBLAS's
# plain GEMM at M = 1,024/4,096 (unfused 0.88x/0.86x) and the SwiGLU kernel goes.
PREFILL_GEMM_SWIGLU = True
# decode_wide's SwiGLU into its gate_up GEMV (8-64 rows), without the norm: 32 kernels fewer a
# 16-row step; c16 TPOT 4.231 -> 4.186 ms, greedy tokens identical (engine_s24_wide_swiglu.json);
# 4B gate_up + SwiGLU 28.8 -> 27.4 µs at 16 rows, 48.6 -> 47.3 at 64
# (gemv_kernel_wide_swiglu_s24.json)
WIDE_SWIGLU = True


def _readers(func: relax.Function) -> dict[relax.Var, int]:
    """How many times each variable is read in `func` (its definitions not counted)."""
    count: dict[relax.Var, int] = {}

    def visit(expr) -> None:
        if isinstance(expr, relax.Var):
            count[expr] = count.get(expr, 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    return count


@relax.expr_functor.mutator
class SwigluFolder(GemvFolder):
    """The pass's mutator: each SwiGLU after a decode GEMM, or a prefill GEMM with
    PREFILL_GEMM_SWIGLU (`fold_module()` for a module)."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        super().__init__(mod, target)
        self.gemms: dict[str, tvm.ir.GlobalVar] = {}

    def begin(self, func: relax.Function) -> None:
        self.readers = _readers(func)

    def _sole_gate_up(self, arg: relax.Expr, inter: int) -> tuple[relax.Call, str] | None:
        """The GEMM call that computes `arg` (through identity reshapes), with its rows
        ("small" decode, "large" prefill), if it is a gate_up of 2 `inter` columns in the
        SwiGLU's dtype that nothing else reads."""
        var, call, func = self.producer(arg)
        if call is None or func.attrs is None:
            return None
        rows = str(func.attrs.get(ROWS_ATTR, ""))
        match = match_gemm(func) if rows in ("small", "wide", "large") else None
        if match is None or match.n != 2 * inter or match.out_dtype != str(call.ty.dtype):
            return None
        while True:  # every variable from the GEMM's output to `arg`: this one reader
            if self.readers.get(arg, 0) != 1:
                return None
            if arg.same_as(var):
                return call, rows
            arg = self.lookup_binding(arg).args[1].fields[0]  # an identity reshape's input

    def _gemm_call(self, call: relax.Call, swiglu_ty) -> relax.Call | None:
        """Prefill's gate_up GEMM `call` as one tensor-core GEMM storing its SwiGLU."""
        name, func = callee(self.mod_, call)
        symbol = name + "_swiglu"
        if symbol not in self.gemms:
            kernel = gemm_for(func, None, "default", swiglu=True)
            if kernel is None:
                return None
            kernel = kernel.with_attr("global_symbol", symbol)
            self.gemms[symbol] = self.builder_.add_func(kernel, symbol)
        return relax.Call(CALL_TIR, [self.gemms[symbol], call.args[1]], call.attrs, [swiglu_ty])

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        called = callee(self.mod_, call)
        if called is None or called[1].attrs is None or INTER_ATTR not in called[1].attrs:
            return call
        found = self._sole_gate_up(call.args[1].fields[0], int(called[1].attrs[INTER_ATTR]))
        if found is None or str(found[0].ty.dtype) != str(call.ty.dtype):
            return call
        gate_up, rows = found
        if rows == "small":
            folded = self.gemv_call(gate_up, swiglu_ty=call.ty_args[0])
        elif rows == "wide":
            folded = (
                self.gemv_call(gate_up, call.ty_args[0], rows, norm_fusion.FOLD_WIDE)
                if WIDE_SWIGLU
                else None
            )
        elif PREFILL_GEMM_SWIGLU:
            folded = self._gemm_call(gate_up, call.ty_args[0])
        else:
            folded = None
        return call if folded is None else folded


def fold_swiglu_into_gemv(target: tvm.target.Target) -> tvm.transform.Pass:
    """The pass, for `target` (a no-op below sm_80, where decode's GEMMs are dlight's)."""
    return gemv_fold_pass("FoldSwigluIntoGemv", SwigluFolder, target)
