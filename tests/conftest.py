"""Shared fixtures: small Qwen3.5 models that differ where it matters, each compiled once
per test session, and HF transformers' reference loaded from the same folder."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import tvm.relax  # noqa: F401  the suite compiles, so the full TVM loads before the runtime's

from qwen35_tvm.compile.config import FULL, LINEAR
from qwen35_tvm.compile.random_model import SHAPES, write_random_model


def _config(**overrides) -> dict:
    cfg = copy.deepcopy(SHAPES["tiny"])
    rope = cfg["rope_parameters"]
    rope["partial_rotary_factor"] = overrides.pop("partial_rotary_factor", 0.25)
    # room for the long-context parity test's 4,200-token prompt
    cfg["max_position_embeddings"] = 8192
    cfg.update(overrides)
    cfg["layer_types"] = overrides.get("layer_types", cfg["layer_types"])
    return cfg


# name -> (config, multimodal folder layout)
MODELS: dict[str, tuple[dict, bool]] = {
    # tied; GDN value heads = 2 x key heads; full attention every 4th layer; head_dim 32 x 0.25
    "tied-gqa2-every4": (_config(), False),
    # untied; value heads = key heads; full attention every 2nd layer; head_dim 64 x 0.5
    "untied-gqa1-every2": (
        _config(
            tie_word_embeddings=False,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            layer_types=[LINEAR, FULL, LINEAR, FULL],
            head_dim=64,
            partial_rotary_factor=0.5,
            num_key_value_heads=1,
        ),
        False,
    ),
    # multimodal folder (text under model.language_model); 5 layers; head_dim 16 x 1.0
    "multimodal-untied-every4": (
        _config(
            tie_word_embeddings=False,
            num_hidden_layers=5,
            layer_types=[LINEAR, LINEAR, LINEAR, FULL, LINEAR],
            head_dim=16,
            partial_rotary_factor=1.0,
        ),
        True,
    ),
}


@dataclass
class CompiledModel:
    name: str
    hf_dir: Path
    artifact_dir: Path


def write_model(name: str, root: Path) -> Path:
    config, multimodal = MODELS[name]
    return write_random_model(config, root / name, seed=1, dtype="float32", multimodal=multimodal)


def compile_model_once(name: str, root: Path, **kwargs) -> CompiledModel:
    from qwen35_tvm.compile.build import compile_model

    hf_dir = write_model(name, root / "hf")
    suffix = "-unmasked" if kwargs.get("_mask_pad") is False else ""
    artifact = compile_model(hf_dir, root / "artifacts" / (name + suffix), **kwargs)
    return CompiledModel(name, hf_dir, artifact)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


_compiled: dict[str, CompiledModel] = {}


@pytest.fixture(scope="session", params=list(MODELS))
def compiled(request, model_root) -> CompiledModel:
    if request.param not in _compiled:
        _compiled[request.param] = compile_model_once(request.param, model_root)
    return _compiled[request.param]


@pytest.fixture(scope="session")
def tiny_compiled(model_root) -> CompiledModel:
    """The first configuration only, for tests that need one model."""
    name = next(iter(MODELS))
    if name not in _compiled:
        _compiled[name] = compile_model_once(name, model_root)
    return _compiled[name]


@pytest.fixture(scope="session")
def tiny_random_artifact(model_root) -> Path:
    """The embedded default, compiled exactly as the README does."""
    from qwen35_tvm.compile.build import compile_model

    return compile_model("tiny-random", model_root / "artifacts" / "tiny-random")
