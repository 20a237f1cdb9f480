"""CUDA builds run `decode` and `decode_wide` as CUDA graphs: TVM's RewriteCUDAGraph must lift
whole layer ranges into captured functions. Only what cannot be captured stays outside: the
embedding lookup and slot copy (they read this step's inputs), RoPE (it reads the KV cache's
positions), the attention calls (a `vm.builtin`) and the logits kernel (its output is returned).
No GPU needed: this inspects the lowered Relax."""

from __future__ import annotations

import re

import pytest
import tvm

from qwen35_tvm.compile.build import build_module
from qwen35_tvm.compile.config import ModelConfig
from qwen35_tvm.compile.model import mark_decode_for_cuda_graph
from qwen35_tvm.compile.pipeline import relax_pipeline
from qwen35_tvm.compile.random_model import SHAPES
from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.compile.vocab import VocabWidths

UNCAPTURED_OK = ("add", "take", "logits", "greedy_pick")


def _lowered(mark: bool) -> tvm.IRModule:
    cfg = ModelConfig.from_hf(SHAPES["tiny"])
    widths = VocabWidths.resolve(cfg.vocab_size, 248077)
    target, _ = make_target("cuda", "sm_80")
    mod, _ = build_module(cfg, widths, "bfloat16", target)
    if not mark:  # the mutation: decode without its capture attributes
        for name in ("decode", "decode_wide"):
            mod[name] = mod[name].without_attr("relax.rewrite_cuda_graph.capture_symbolic_vars")
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        return relax_pipeline(target)(mod)


def _kernels_outside_graphs(mod: tvm.IRModule, fn: str) -> list[str]:
    """PrimFunc calls left in `fn` itself, i.e. launched one by one, not replayed."""
    text = mod[fn].script()
    return [k for k in re.findall(r"^    (\w+)\(", text, re.M) if not k.startswith("shape_func")]


@pytest.fixture(scope="module")
def lowered() -> tvm.IRModule:
    return _lowered(mark=True)


@pytest.mark.parametrize("fn", ["decode", "decode_wide"])
def test_decode_layers_are_captured(lowered, fn) -> None:
    text = lowered[fn].script()
    assert text.count("vm.builtin.cuda_graph.run_or_capture") >= 2, fn
    outside = _kernels_outside_graphs(lowered, fn)
    gdn = [k for k in outside if k.startswith("gdn") or "matmul" in k]
    assert not gdn, f"{fn} launches these one by one: {gdn}"
    rest = [k for k in outside if k not in UNCAPTURED_OK and not k.startswith("fused_cast")]
    assert not rest, f"{fn}: unexpected kernels outside the graphs: {rest}"


def test_without_the_capture_attributes_the_layers_run_kernel_by_kernel() -> None:
    # Guards the test above: the decode functions' attributes are what makes capture work.
    mod = _lowered(mark=False)
    outside = _kernels_outside_graphs(mod, "decode")
    assert any(k.startswith("gdn") for k in outside) or any("matmul" in k for k in outside)


def test_mark_sets_fixed_inputs_and_the_batch_bound() -> None:
    cfg = ModelConfig.from_hf(SHAPES["tiny"])
    widths = VocabWidths.resolve(cfg.vocab_size, 248077)
    mod, _ = build_module(cfg, widths, "float32", make_target("llvm")[0])
    mod = mark_decode_for_cuda_graph(mod, 8)
    attrs = mod["decode"].attrs
    params = [p.name for p in mod["decode"].params]
    assert params[: int(attrs["num_input"])] == ["input_ids", "slots", "kv_cache"]
    assert int(attrs["tir_var_upper_bound"]["batch"]) == 8
