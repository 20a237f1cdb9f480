"""The whole model builds for CUDA on this GPU-less machine, with real SASS per arch."""

from __future__ import annotations

import json

from qwen35_tvm.compile.cuda_toolchain import fatbin_arches


def test_tiny_random_cuda_library_carries_sass_for_each_arch(cuda_library):
    out = cuda_library.artifact_dir
    # every decode ("small") and decode_wide ("wide") GEMM the build schedules must become our
    # GEMV (schedules/gemv.py). Decode's and decode_wide's GEMMs behind a norm are our GEMV
    # already, the norm folded in (compile/norm_fusion.py), and so is each gate_up, its SwiGLU
    # folded in (compile/swiglu_fusion.py): the rule sees the rest (tiny: the output
    # projections, down)
    for rows, got in cuda_library.gemv_rule.items():
        assert len(got) >= 2 and all(got.values()), (rows, got)
    meta = json.loads((out / "artifact.json").read_text())
    assert meta["target"] == "cuda" and meta["arch"] == ["sm_80", "sm_90"]
    assert meta["weights"] is None
    arches = fatbin_arches(out / "model.so")
    assert arches["sass"] == ["sm_80", "sm_90"]
    assert arches["ptx"] == ["compute_80"]
    lib = (out / "model.so").read_bytes()
    assert b"__global__" not in lib
    assert b"_small_rms_norm" in lib and b"_wide_rms_norm" in lib
    # decode's and decode_wide's gate_up GEMVs with the norm and the SwiGLU folded in
    # (compile/swiglu_fusion.py)
    assert b"_small_rms_norm_swiglu" in lib and b"_wide_rms_norm_swiglu" in lib
    # our attention and our KV cache only: none of TVM's kernels or KV-cache builtins
    assert b"attn_paged" in lib and b"attn_append_kv" in lib
    for name in (b"batch_decode_paged_kv", b"batch_prefill_", b"kv_state", b"attention_kv_cache"):
        assert name not in lib, name


def test_runtime_calls_no_kv_cache_builtin():
    from pathlib import Path

    import qwen35_tvm.runtime as runtime

    for path in Path(runtime.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "kv_state" not in text and "attention_kv_cache" not in text, path.name


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
