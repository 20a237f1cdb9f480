"""Relax-to-library pipelines: TVM's default for the CPU; for CUDA, TVM's default with

- `x · Wᵀ` fused into one NT matmul reading W as stored (`FuseTransposeMatmul`), so no weight is
  transposed per call;
- each GEMM split by the rows its callers see (FuseTIR hands every graph the same PrimFuncs) and
  marked: bf16 GEMMs of prefill get our tensor-core kernel (schedules/matmul.py), decode's and
  wide decode's (8-64 sequences) our GEMV (schedules/gemv.py: one pass over the weight for up
  to 64 rows), the rest dlight's GEMV rules (`gpu.Matmul` skips decode's);
- dlight kept off the tensor-core path of `gpu.Matmul`, which segfaults in TVM 0.27 with
  apache-tvm-ffi 0.1.15 (`Schedule.tensorize` -> JSON serializer; see schedules/matmul.py).
  (`gpu.RMSNorm`, which fails on a plain norm, is not in the list.)"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.backend.cuda import pipeline as cuda_pipeline
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight import ScheduleRule
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from ..schedules.gemm_match import match_gemm
from ..schedules.gemv_rule import DecodeGemv
from ..schedules.matmul_config import ROWS_ATTR, WIDE_DECODE_CONFIG
from ..schedules.matmul_rule import MatmulMMA
from ..schedules.pdl import WAIT_CALL
from .norm_fusion import fold_norms_into_gemv
from .swiglu_fusion import fold_swiglu_into_gemv

# Exported Relax functions by how many rows their projections see: prefill a whole prompt
# chunk ("large"), decode_wide 8-64 sequences ("wide"), decode fewer ("small").
ROW_CLASSES = {
    "prefill": "large", "prefill_prompts": "large", "decode_wide": "wide", "decode": "small"
}  # fmt: skip
GEMM_DTYPES = ("bfloat16", "float32")  # split and marked; only bf16 has the tensor-core kernel


@tvm.transform.module_pass(opt_level=0, name="MarkNoTensorize")
def _mark_no_tensorize(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions.items()):
        if isinstance(func, tvm.tirx.PrimFunc) and not func.attrs.get("tirx.is_scheduled"):
            mod[gv] = func.with_attr("dlight.do_not_tensorize", True)
    return mod


def _called_prim_funcs(func: relax.Function) -> list[tvm.ir.GlobalVar]:
    call_tir = tvm.ir.Op.get("relax.call_tir")
    found: list[tvm.ir.GlobalVar] = []

    def visit(expr) -> None:
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            gv = expr.args[0]
            if isinstance(gv, tvm.ir.GlobalVar) and not any(gv.same_as(g) for g in found):
                found.append(gv)

    relax.analysis.post_order_visit(func.body, visit)
    return found


@relax.expr_functor.mutator
class _Retarget(relax.PyExprMutator):
    """Points call_tir at other PrimFuncs: {old GlobalVar name: new GlobalVar}."""

    def __init__(self, mod: tvm.IRModule, mapping: dict[str, tvm.ir.GlobalVar]):
        super().__init__(mod)
        self.mapping = mapping

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        target = call.args[0] if call.args else None
        if (
            isinstance(call, relax.Call)
            and call.op.same_as(tvm.ir.Op.get("relax.call_tir"))
            and isinstance(target, tvm.ir.GlobalVar)
            and target.name_hint in self.mapping
        ):
            args = [self.mapping[target.name_hint], *call.args[1:]]
            return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)
        return call


@tvm.transform.module_pass(opt_level=0, name="SplitGemmsByRows")
def _split_gemms_by_rows(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Mark each fused GEMM with the row class of its callers (ROW_CLASSES, as ROWS_ATTR); a
    GEMM called from functions of several classes is copied, one copy per class."""
    funcs = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, relax.Function)}
    callers: dict[str, set[str]] = {}
    for name, func in funcs.items():
        for gv in _called_prim_funcs(func):
            callers.setdefault(gv.name_hint, set()).add(name)
    gemms = {
        name
        for name in callers
        if not mod[name].attrs.get("tirx.is_scheduled")
        and match_gemm(mod[name], GEMM_DTYPES) is not None
    }
    mutator = _Retarget(mod, {})
    builder = mutator.builder_
    retarget: dict[str, dict[str, tvm.ir.GlobalVar]] = {fn: {} for fn in ROW_CLASSES}
    for name in sorted(gemms):
        func, gv = mod[name], mod.get_global_var(name)
        classes = sorted({ROW_CLASSES[fn] for fn in callers[name] if fn in ROW_CLASSES})
        for i, rows in enumerate(classes):
            marked = func.with_attr(ROWS_ATTR, rows)
            if i == 0:
                builder.update_func(gv, marked)
                continue
            copy = builder.add_func(marked, f"{name}_{rows}")
            for fn in callers[name]:
                if ROW_CLASSES.get(fn) == rows:
                    retarget[fn][name] = copy
    for fn, mapping in retarget.items():
        if mapping:
            mutator.mapping = mapping
            builder.update_func(mod.get_global_var(fn), mutator.visit_expr(funcs[fn]))
    return builder.get()


class _LargeMOnly(GPUScheduleRule):
    """`rule` for every function except the decode GEMMs, which are left to the GEMV rules
    behind it (dlight's Matmul would otherwise take them first and tile m by 32+)."""

    def __init__(self, rule: GPUScheduleRule):
        self.rule = rule

    def apply(self, func: tvm.tirx.PrimFunc, target: tvm.target.Target, tunable: bool):
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs.get(ROWS_ATTR) in ("small", "wide"):
            return None
        return self.rule.apply(func, target, tunable)


def fusion_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """The CUDA pipeline up to scheduling: Relax ops to fused PrimFuncs, GEMMs split and marked.
    Run inside `with target:`."""
    return [
        *cuda_pipeline.library_dispatch_passes(target),
        relax.transform.FuseTransposeMatmul(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        _split_gemms_by_rows,
        # the SwiGLU first: it takes gate_up's norm along; the norm fold takes the rest
        fold_swiglu_into_gemv(target),
        fold_norms_into_gemv(target),
        _mark_no_tensorize,
    ]


def schedule_rules() -> list[ScheduleRule]:
    """dlight rules, first match wins: prefill's bf16 GEMMs to tensor cores, wide decode's and
    decode's to our GEMV (schedules/gemv.py; the tiled tensor-core GEMM stays behind for wide
    decode's GEMMs it cannot take), other prefill GEMMs to SIMT tiles, the rest of decode's to
    dlight's GEMV."""
    return [
        MatmulMMA(),
        DecodeGemv(rows="wide"),
        MatmulMMA(WIDE_DECODE_CONFIG, rows="wide"),
        _LargeMOnly(dl.gpu.Matmul()),
        DecodeGemv(),
        dl.gpu.GEMV(),
        dl.gpu.LowBatchGEMV(4),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]


@tvm.transform.module_pass(opt_level=0, name="ReturnOutsideGraph")
def _return_outside_graph(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Move the binding of a captured function's return value into a block of its own.

    RewriteCUDAGraph lifts a static tuple into the region around it but counts only later
    bindings as uses, not the function's return: a decode whose outputs all come from inside
    its one graph would return a variable the graph never hands back. A binding block of its
    own starts no region, and its reads mark the region's outputs."""
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or not func.attrs:
            continue
        if "relax.rewrite_cuda_graph.capture_symbolic_vars" not in func.attrs:
            continue
        body = func.body
        last = body.blocks[-1]
        ret = last.bindings[-1] if last.bindings else None
        if ret is None or not ret.var.same_as(body.body):
            continue
        head = relax.BindingBlock(last.bindings[:-1])
        blocks = [*body.blocks[:-1], head, relax.BindingBlock([ret])]
        new_body = relax.SeqExpr(blocks, body.body, body.span)
        mod[gv] = relax.Function(
            func.params, new_body, func.ret_ty, func.is_pure, func.attrs, func.span
        )
    return mod


def _finalize_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    passes = cuda_pipeline.finalize_passes(target)
    at = next(i for i, p in enumerate(passes) if p.info.name == "RewriteCUDAGraph")
    return [*passes[:at], _return_outside_graph, *passes[at:]]


def relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass | str:
    if target.kind.name != "cuda":
        return "default"

    @tvm.transform.module_pass(opt_level=0, name="Qwen35CUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            passes = [
                *fusion_passes(target),
                dl.ApplyDefaultSchedule(*schedule_rules()),
                *cuda_pipeline.dataflow_lower_passes(target),
                *_finalize_passes(target),
            ]
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


# ---- TIR: programmatic dependent launch ----------------------------------------------------

PDL_TAG = "tirx.use_programtic_dependent_launch"  # sic: TVM's runtime spells it so
DYN_SHARED_TAG = "tirx.use_dyn_shared_memory"  # must stay the last launch tag
TIR_PIPELINE = "qwen35_cuda"


def waits_for_producers(func: tvm.tirx.PrimFunc) -> bool:
    """Whether the kernel calls schedules/pdl.py's wait_for_producers (read from the printed
    TIR: this TVM has no Python TIR visitor)."""
    return WAIT_CALL in func.script()


@tvm.transform.module_pass(opt_level=0, name="TagDependentLaunch")
def tag_dependent_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Launch with programmatic stream serialisation exactly the device kernels that wait for
    their producers (schedules/pdl.py); any other kernel keeps starting after its producer."""
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tvm.tirx.PrimFunc) or not func.attrs:
            continue
        tags = [str(t) for t in func.attrs.get("tirx.kernel_launch_params", None) or []]
        if not tags or PDL_TAG in tags or not waits_for_producers(func):
            continue
        last = [t for t in tags if t == DYN_SHARED_TAG]
        tags = [t for t in tags if t != DYN_SHARED_TAG] + [PDL_TAG] + last
        mod[gv] = func.with_attr("tirx.kernel_launch_params", tags)
    return mod


def tir_pipeline(target: tvm.target.Target) -> str:
    """The name of TVM's default TIR pipeline for `target` followed, on CUDA, by
    TagDependentLaunch."""
    if target.kind.name != "cuda":
        return "default"

    def factory(**_kwargs):
        lower, host, device = tvm.tirx.get_default_tir_pipeline(target)
        return (lambda mod: tag_dependent_launch(lower(mod))), host, device

    tvm.tirx.register_tir_pipeline(TIR_PIPELINE, factory)
    return TIR_PIPELINE
