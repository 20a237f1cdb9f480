"""Conversion folds a decoder layer's two norms into the projections that read them
(compile/convert.py FOLDED_NORMS): in_proj / qkv_proj take input_layernorm's (1 + w) and
gate_up_proj takes post_attention_layernorm's, column by column, and the norms have no
parameter left. An artifact whose parameters still list a norm (a library built before the
fold) keeps that norm's weight and gets the projection unfolded, so no weight is applied twice.

The end-to-end check is the parity suite (tests/test_parity*.py: the folded model against HF's
unfolded one); here the arrays themselves.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from qwen35_tvm.compile.convert import FOLDED_NORMS, converted_params
from qwen35_tvm.compile.hf_folder import HFModelFolder
from qwen35_tvm.compile.random_model import SHAPES, write_random_model

# layer 0 is a GDN layer and layer 3 a full-attention one in the tiny model
PROJECTIONS = {
    "layers.0.linear_attn.in_proj.weight": (
        [f"layers.0.linear_attn.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")],
        "layers.0.input_layernorm.weight",
    ),
    "layers.3.self_attn.qkv_proj.weight": (
        [f"layers.3.self_attn.{x}_proj.weight" for x in ("q", "k", "v")],
        "layers.3.input_layernorm.weight",
    ),
    "layers.3.mlp.gate_up_proj.weight": (
        ["layers.3.mlp.gate_proj.weight", "layers.3.mlp.up_proj.weight"],
        "layers.3.post_attention_layernorm.weight",
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> HFModelFolder:
    return HFModelFolder(write_random_model(SHAPES["tiny"], tmp_path_factory.mktemp("m"),
                                            dtype="float32"))  # fmt: skip


def _params(folder: HFModelFolder, names: list[str]) -> dict[str, np.ndarray]:
    return dict(converted_params(folder, names, "float32"))


@pytest.mark.parametrize("name", list(PROJECTIONS))
def test_projection_takes_its_norm_column_by_column(folder, name) -> None:
    sources, norm = PROJECTIONS[name]
    w = np.concatenate([folder.get(s).astype(np.float32) for s in sources], axis=0)
    gain = 1.0 + folder.get(norm).astype(np.float32)
    assert np.abs(gain - 1).max() > 0.01  # the random norm is not the identity
    got = _params(folder, [name])[name]
    np.testing.assert_allclose(got, w * gain[None, :], rtol=1e-6)
    # not along the rows (the other axis an off-by-transpose fold would use)
    assert not np.allclose(got, w, rtol=1e-3)


@pytest.mark.parametrize("name", list(PROJECTIONS))
def test_a_listed_norm_keeps_its_weight_and_the_projection_stays_plain(folder, name) -> None:
    sources, norm = PROJECTIONS[name]
    got = _params(folder, [name, norm])
    w = np.concatenate([folder.get(s).astype(np.float32) for s in sources], axis=0)
    np.testing.assert_array_equal(got[name], w)
    np.testing.assert_allclose(got[norm], 1.0 + folder.get(norm).astype(np.float32))


def test_the_model_has_no_parameter_for_a_folded_norm(tiny_compiled) -> None:
    meta = json.loads((tiny_compiled.artifact_dir / "artifact.json").read_text())
    names = {p["name"] for p in meta["params"]}
    for proj, norm in FOLDED_NORMS.items():
        projections = [n for n in names if n.endswith(proj)]
        assert projections, proj
        for name in projections:
            assert name.removesuffix(proj) + norm not in names, name
    assert "norm.weight" in names  # the final norm feeds the logits kernel: kept
