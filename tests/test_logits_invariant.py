"""The vocab-padding invariant: logits are `selection` wide, the pad columns are -inf on every
path, and only the logits kernel reads the output projection weight."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from conftest import compile_model_once
from tvm import relax

from qwen35_tvm.compile.build import build_module
from qwen35_tvm.compile.config import ModelConfig
from qwen35_tvm.compile.hf_folder import resolve_model
from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.compile.vocab import VocabError, VocabWidths
from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.model_runner import ModelRunner


def pad_mask_violations(artifact_dir) -> list[str]:
    """Run every logits path of the model; name each one whose pad columns are not -inf or
    whose decodable columns are not finite."""
    artifact = Artifact(artifact_dir)
    w = artifact.widths
    runner = ModelRunner(artifact, max_batch_size=2, max_total_tokens=64, num_slots=2)
    ids = np.random.default_rng(0).integers(0, w.decodable, size=20).tolist()
    paths = {}
    runner.add_sequence(0, [0, 1])
    runner.add_sequence(1, [2, 3])
    paths["prefill, last token"] = runner.forward([0], [ids])
    paths["prefill, every token"] = runner.forward([1], [ids], all_logits=True)
    paths["batched decode"] = runner.forward([0, 1], [[ids[0]], [ids[1]]])
    violations = []
    for name, logits in paths.items():
        if logits.shape[1] != w.selection:
            violations.append(f"{name}: width {logits.shape[1]} != selection {w.selection}")
        if not np.all(np.isneginf(logits[:, w.decodable : w.selection])):
            violations.append(f"{name}: pad columns [{w.decodable}, {w.selection}) not -inf")
        if not np.all(np.isfinite(logits[:, : w.decodable])):
            violations.append(f"{name}: decodable columns not all finite")
    return violations


def test_every_logits_path_masks_the_pad_columns(tiny_compiled):
    assert pad_mask_violations(tiny_compiled.artifact_dir) == []


def test_mask_test_fails_on_an_unmasked_build(model_root):
    """Mutation check: the same model built without the mask must fail the test above."""
    unmasked = compile_model_once("tied-gqa2-every4", model_root, _mask_pad=False)
    meta = json.loads((unmasked.artifact_dir / "artifact.json").read_text())
    assert meta["logits_pad_masked"] is False
    violations = pad_mask_violations(unmasked.artifact_dir)
    assert len(violations) == 3 and all("pad columns" in v for v in violations)


def test_every_greedy_pick_counts_only_the_decodable_columns(tiny_compiled):
    """Prefill (last token and every token) and decode pick on the device; each pick must be
    its row's argmax over the decodable columns, with that column's log-softmax."""
    artifact = Artifact(tiny_compiled.artifact_dir)
    w = artifact.widths
    runner = ModelRunner(artifact, max_batch_size=2, max_total_tokens=64, num_slots=2)
    ids = np.random.default_rng(1).integers(0, w.decodable, size=17).tolist()
    runner.add_sequence(0, [0, 1])
    runner.add_sequence(1, [2, 3])
    steps = {
        "prefill, last token": runner.forward_step([0], [ids]),
        "prefill, every token": runner.forward_step([1], [ids[:5]], all_logits=True),
        "batched decode": runner.forward_step([0, 1], [[ids[0]], [ids[1]]]),
    }
    for name, step in steps.items():
        rows = step.rows()[:, : w.decodable].astype(np.float64)
        assert step.best is not None, name
        np.testing.assert_array_equal(step.best, np.argmax(rows, axis=1), err_msg=name)
        top = rows.max(axis=1, keepdims=True)
        lsm = rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))
        expect = lsm[np.arange(len(rows)), step.best]
        np.testing.assert_allclose(step.best_logprob, expect, atol=1e-4, err_msg=name)


def test_tiny_random_artifact_records_the_three_widths(tiny_random_artifact):
    meta = json.loads((tiny_random_artifact / "artifact.json").read_text())
    assert meta["vocab"] == {"rows": 248320, "decodable": 248077, "selection": 248192}
    assert meta["logits_pad_masked"] is True


@pytest.mark.parametrize(
    "rows, decodable, selection",
    [
        (248320, 248077, 248192),  # Qwen3.5: round up to 128
        (248320, 248192, 248192),  # already a multiple of 128: unchanged
        (248100, 248077, 248100),  # round-up would pass the rows: clamp
        (1000, 1000, 1000),
    ],
)
def test_width_arithmetic(rows, decodable, selection):
    assert VocabWidths.resolve(rows, decodable).selection == selection


def test_more_decodable_ids_than_rows_is_refused():
    with pytest.raises(VocabError, match="decodes 248077 ids but the checkpoint has only 1000"):
        VocabWidths.resolve(1000, 248077)


def _weight_users(func: relax.Function, param_index: int) -> list[str]:
    """What consumes the packed parameter `param_index` in a Relax function."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    packed = func.params[-1]
    weight = [
        b.var
        for b in bindings
        if isinstance(b.value, relax.TupleGetItem)
        and b.value.tuple_value.same_as(packed)
        and b.value.index == param_index
    ]
    assert len(weight) == 1
    users = []
    for b in bindings:
        value = b.value
        args = list(value.args) if isinstance(value, relax.Call) else [value]
        flat = [f for a in args for f in (a.fields if isinstance(a, relax.Tuple) else [a])]
        if any(isinstance(a, relax.Var) and a.same_as(weight[0]) for a in flat):
            # decode writes its logits into a fixed buffer: call_tir_inplace
            if isinstance(value, relax.Call) and value.op.name.startswith("relax.call_tir"):
                users.append("call_tir:" + value.args[0].name_hint)
            elif isinstance(value, relax.Call):
                users.append(value.op.name)
            else:
                users.append(type(value).__name__)
    return users


@pytest.mark.parametrize("tied", [True, False])
def test_only_the_logits_kernel_reads_the_output_projection(tied):
    folder = resolve_model("tiny-random")
    raw = folder.config.to_dict() | {"model_type": "qwen3_5_text", "tie_word_embeddings": tied}
    raw["rope_parameters"] = {"rope_theta": raw.pop("rope_theta")}
    config = ModelConfig.from_hf(raw)
    widths = VocabWidths.resolve(config.vocab_size, 248077)
    mod, named = build_module(config, widths, "float32", make_target("llvm")[0])
    names = [n for n, _ in named]
    head = "embed_tokens.weight" if tied else "lm_head.weight"
    for fn in ("prefill", "decode", "decode_wide"):
        users = _weight_users(mod[fn], names.index(head))
        # tied, the table is also the embedding: prefill's take, decode's first kernel (rows
        # by token id only)
        gather = "relax.take" if fn == "prefill" else "call_tir:decode_inputs"
        expected = [gather, "call_tir:logits"] if tied else ["call_tir:logits"]
        assert sorted(users) == sorted(expected), fn
    assert isinstance(mod, tvm.IRModule)
