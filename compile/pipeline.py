"""Relax-to-library pipelines: TVM's default for the CPU; for CUDA, TVM's default with dlight
kept off the tensor-core path of `gpu.Matmul`, which segfaults for fp16/bf16 on sm >= 70 in
TVM 0.27. (`gpu.RMSNorm`, which fails on a plain norm, is not in the list.)"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.backend.cuda import pipeline as cuda_pipeline
from tvm.s_tir import dlight as dl


@tvm.transform.module_pass(opt_level=0, name="MarkNoTensorize")
def _mark_no_tensorize(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions.items()):
        if isinstance(func, tvm.tirx.PrimFunc) and not func.attrs.get("tirx.is_scheduled"):
            mod[gv] = func.with_attr("dlight.do_not_tensorize", True)
    return mod


def relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass | str:
    if target.kind.name != "cuda":
        return "default"

    @tvm.transform.module_pass(opt_level=0, name="Qwen35CUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            passes = [
                *cuda_pipeline.library_dispatch_passes(target),
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                _mark_no_tensorize,
                dl.ApplyDefaultSchedule(
                    dl.gpu.Matmul(),
                    dl.gpu.GEMV(),
                    dl.gpu.LowBatchGEMV(4),
                    dl.gpu.Reduction(),
                    dl.gpu.GeneralReduction(),
                    dl.gpu.Fallback(),
                ),
                *cuda_pipeline.dataflow_lower_passes(target),
                *cuda_pipeline.finalize_passes(target),
            ]
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
