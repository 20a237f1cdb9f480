"""Reading HF folders: unsupported or inconsistent configs and weights are refused with a
message that names the field or tensor."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qwen35_tvm.compile.config import ConfigError, ModelConfig
from qwen35_tvm.compile.hf_folder import HFModelFolder, WeightError
from qwen35_tvm.compile.random_model import SHAPES, write_random_model

BASE = SHAPES["tiny"]


def _with(**changes) -> dict:
    cfg = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"model_type": "qwen3_5_moe_text"}, "MoE"),
        ({"model_type": "llama"}, "model_type"),
        ({"num_experts": 8}, "num_experts"),
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"num_hidden_layers": 5}, "layer_types"),
        (
            {"layer_types": ["linear_attention", "x", "full_attention", "full_attention"]},
            "layer_types",
        ),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"linear_num_value_heads": 3}, "linear_num_key_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7}}, "rope_type"),
        ({"rope_parameters": {}}, "rope_theta"),
    ],
)
def test_unsupported_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(_with(**changes))


def test_multimodal_and_text_configs_resolve_alike():
    text = ModelConfig.from_hf(BASE)
    wrapped = {"model_type": "qwen3_5", "text_config": BASE, "tie_word_embeddings": True}
    assert ModelConfig.from_hf(wrapped) == text
    assert text.full_layers == (3,) and text.linear_layers == (0, 1, 2)
    assert text.rotary_dim == 8


def test_weight_shape_mismatch_names_the_tensor(tmp_path):
    folder = write_random_model(BASE, tmp_path / "m", dtype="float32")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    tensors[name] = np.zeros((3, 3), np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightError, match=name.replace(".", r"\.")):
        HFModelFolder(folder).get("layers.0.linear_attn.in_proj_z.weight")


def test_missing_tensor_is_named(tmp_path):
    folder = write_random_model(BASE, tmp_path / "m", dtype="float32")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightError, match="missing tensor 'norm.weight'"):
        HFModelFolder(folder).check()


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match="no config.json"):
        HFModelFolder(tmp_path)
