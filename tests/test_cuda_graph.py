"""CUDA builds run each decode step as one CUDA graph: TVM's RewriteCUDAGraph must lift the whole
of `decode` and `decode_wide`, embedding to greedy pick, into a single captured function. Every
argument is a buffer the runner keeps at a fixed address, so no kernel is left outside; the only
work outside the graph is the runner's host-to-device copy of the step's inputs and the copy of
the picks back. No GPU needed: this inspects the lowered Relax."""

from __future__ import annotations

import re

import pytest
import tvm
from tvm import relax

from qwen35_tvm.compile.build import build_module
from qwen35_tvm.compile.config import ModelConfig
from qwen35_tvm.compile.exports import mark_decode_for_cuda_graph
from qwen35_tvm.compile.pipeline import relax_pipeline
from qwen35_tvm.compile.random_model import SHAPES
from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.compile.vocab import VocabWidths


def _copy(mod: tvm.IRModule, relax_functions=None) -> tvm.IRModule:
    """A module of the same functions (all PrimFuncs, and the named Relax ones if given), so that
    replacing one leaves the fixture's module as it was."""
    return tvm.IRModule(
        {
            gv: f
            for gv, f in mod.functions_items()
            if relax_functions is None
            or not isinstance(f, relax.Function)
            or gv.name_hint in relax_functions
        }
    )


def _lower(mod: tvm.IRModule, target) -> tvm.IRModule:
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        return relax_pipeline(target)(mod)


@pytest.fixture(scope="module")
def built() -> tuple[tvm.IRModule, tvm.target.Target]:
    """The tiny model's bf16 CUDA module before lowering, built once for this file."""
    cfg = ModelConfig.from_hf(SHAPES["tiny"])
    target, _ = make_target("cuda", "sm_80")
    mod, _ = build_module(cfg, VocabWidths.resolve(cfg.vocab_size, 248077), "bfloat16", target)
    return mod, target


def _kernels_outside_graphs(mod: tvm.IRModule, fn: str) -> list[str]:
    """PrimFunc calls left in `fn` itself, i.e. launched one by one, not replayed."""
    text = mod[fn].script()
    return [k for k in re.findall(r"^    (\w+)\(", text, re.M) if not k.startswith("shape_func")]


@pytest.fixture(scope="module")
def lowered(built) -> tvm.IRModule:
    return _lower(_copy(built[0]), built[1])


@pytest.mark.parametrize("fn", ["decode", "decode_wide"])
def test_a_decode_step_is_one_graph(lowered, fn) -> None:
    text = lowered[fn].script()
    assert text.count("vm.builtin.cuda_graph.run_or_capture") == 1, fn
    assert _kernels_outside_graphs(lowered, fn) == [], fn
    # one graph per batch size: the batch is the capture key
    assert re.search(r"run_or_capture\", \(.*\), \d+, gv\d+\), ty_args", text, re.S), fn
    captured = lowered[f"{fn}_cuda_graph_capture"].script()
    kernels = ("decode_inputs", "attn_append_kv", "attn_paged", "gdn_", "logits", "greedy_pick")
    for kernel in kernels:
        assert kernel in captured, f"{fn}: {kernel} is not in the graph"
    assert "kv_state" not in captured and "attention_kv_cache" not in captured


def test_without_the_capture_attributes_the_layers_run_kernel_by_kernel(built) -> None:
    # Guards the test above: the decode functions' attributes are what makes capture work.
    # `decode` is lowered alone (the other entry points dropped): a tenth of the pipeline's time.
    mod = _copy(built[0], relax_functions={"decode"})
    assert _kernels_outside_graphs(_lower(mod, built[1]), "decode") == []  # alone, as a whole
    for attr in ("relax.rewrite_cuda_graph.capture_symbolic_vars", "num_input"):
        mod["decode"] = mod["decode"].without_attr(attr)
    outside = _kernels_outside_graphs(_lower(mod, built[1]), "decode")
    assert "attn_paged" in outside and "greedy_pick" in outside


def test_mark_sets_fixed_inputs_and_the_batch_bound(built) -> None:
    mod = mark_decode_for_cuda_graph(_copy(built[0]), 8)
    attrs = mod["decode"].attrs
    params = [p.name for p in mod["decode"].params]
    assert int(attrs["num_input"]) == 0  # every argument is a fixed buffer
    assert params[:4] == ["step", "logits_out", "best_out", "logprob_out"]
    assert int(attrs["tir_var_upper_bound"]["batch"]) == 8
