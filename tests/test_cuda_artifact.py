"""The whole model builds for CUDA on this GPU-less machine, with real SASS per arch."""

from __future__ import annotations

import json

from qwen35_tvm.compile.build import compile_model
from qwen35_tvm.compile.cuda_toolchain import fatbin_arches


def test_tiny_random_cuda_library_carries_sass_for_each_arch(model_root):
    out = compile_model(
        "tiny-random",
        model_root / "cuda-tiny",
        target="cuda",
        arch="sm_90,sm_80",
        dtype="bfloat16",
        convert=False,
    )
    meta = json.loads((out / "artifact.json").read_text())
    assert meta["target"] == "cuda" and meta["arch"] == ["sm_80", "sm_90"]
    assert meta["weights"] is None
    arches = fatbin_arches(out / "model.so")
    assert arches["sass"] == ["sm_80", "sm_90"]
    assert arches["ptx"] == ["compute_80"]
    assert b"__global__" not in (out / "model.so").read_bytes()


def test_tensor_core_logits_kernel_builds_for_real_shapes(tmp_path):
    """The bf16 mma logits kernel (which tiny shapes do not reach) compiles to SASS."""
    import tvm

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.logits import logits_projection

    target, arches = make_target("cuda", "sm_80,sm_90")
    prepare_cuda_codegen(arches)
    func = logits_projection(2560, 248320, 248077, 248192, "bfloat16", target)
    lib = tvm.compile(tvm.IRModule({"logits": func}), target=target)
    lib.export_library(str(tmp_path / "logits.so"))
    assert fatbin_arches(tmp_path / "logits.so")["sass"] == ["sm_80", "sm_90"]
