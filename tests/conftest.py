"""Shared fixtures: small Qwen3.5 models that differ where it matters, each compiled once a
test run (once for all pytest-xdist workers), and HF transformers' reference loaded from the
same folder; the tiny model's CUDA library, built once for the tests that read it."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tvm.relax  # noqa: F401  the suite compiles, so the full TVM loads before the runtime's
from filelock import FileLock

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


def built_once(root: Path, name: str, build: Callable[[Path], object]) -> Path:
    """`root/name`, made by build(path) in whichever pytest-xdist worker asks first; the others
    wait for it and reuse it, so a run compiles each shared model once, not once a worker."""
    root.mkdir(parents=True, exist_ok=True)
    out = root / name
    with FileLock(str(root / f".{name}.lock")):
        if not (root / f".{name}.done").exists():
            build(out)
            (root / f".{name}.done").touch()
    return out


def compile_model_once(name: str, root: Path, **kwargs) -> CompiledModel:
    from qwen35_tvm.compile.build import compile_model

    hf_dir = built_once(root / "hf", name, lambda out: write_model(name, out.parent))
    suffix = "-unmasked" if kwargs.get("_mask_pad") is False else ""
    artifact = built_once(
        root / "artifacts", name + suffix, lambda out: compile_model(hf_dir, out, **kwargs)
    )
    return CompiledModel(name, hf_dir, artifact)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    """Models shared by the whole run: under xdist, the workers' common temp folder."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session", params=list(MODELS))
def compiled(request, model_root) -> CompiledModel:
    return compile_model_once(request.param, model_root)


@pytest.fixture(scope="session")
def tiny_compiled(model_root) -> CompiledModel:
    """The first configuration only, for tests that need one model."""
    return compile_model_once(next(iter(MODELS)), model_root)


@pytest.fixture(scope="session")
def tiny_random_artifact(model_root) -> Path:
    """The embedded default, compiled exactly as the README does."""
    from qwen35_tvm.compile.build import compile_model

    return built_once(
        model_root / "artifacts", "tiny-random", lambda out: compile_model("tiny-random", out)
    )


@dataclass
class CudaLibrary:
    """tiny-random's bf16 CUDA artifact (sm_80 + sm_90, no weights), the CUDA source handed to
    nvcc, and which decode GEMMs the GEMV rule scheduled ({rows: {function: scheduled}})."""

    artifact_dir: Path
    source: str
    gemv_rule: dict[str, dict[str, bool]]


def _build_cuda_library(out: Path) -> None:
    from qwen35_tvm.compile import cuda_toolchain
    from qwen35_tvm.compile.build import compile_model
    from qwen35_tvm.schedules.gemv_rule import DecodeGemv
    from qwen35_tvm.schedules.matmul_config import ROWS_ATTR

    sources: list[str] = []
    seen: dict[str, dict[str, bool]] = {"small": {}, "wide": {}}
    compile_fatbin, apply = cuda_toolchain.compile_fatbin, DecodeGemv.apply

    def recording_fatbin(code, arches):
        sources.append(code)
        return compile_fatbin(code, arches)

    def recording_apply(self, func, target, tunable):
        sch = apply(self, func, target, tunable)
        rows = func.attrs.get(ROWS_ATTR) if func.attrs is not None else None
        if rows == self.rows:
            got = seen[rows]
            got[str(func.attrs.get("global_symbol", len(got)))] = sch is not None
        return sch

    cuda_toolchain.compile_fatbin, DecodeGemv.apply = recording_fatbin, recording_apply
    try:
        # arches out of order on purpose: the artifact lists them sorted
        compile_model("tiny-random", out / "artifact", target="cuda", arch="sm_90,sm_80",
                      dtype="bfloat16", convert=False)  # fmt: skip
    finally:
        cuda_toolchain.compile_fatbin, DecodeGemv.apply = compile_fatbin, apply
    assert len(sources) == 1, "one nvcc call a library"
    (out / "source.cu").write_text(sources[0])
    (out / "gemv_rule.json").write_text(json.dumps(seen))


@pytest.fixture(scope="session")
def cuda_library(model_root) -> CudaLibrary:
    """Built once a run (~3 min of TVM and nvcc): the SASS, dependent-launch and GEMV-rule
    tests all read the same library."""
    out = built_once(model_root, "cuda-tiny", _build_cuda_library)
    gemv_rule = json.loads((out / "gemv_rule.json").read_text())
    return CudaLibrary(out / "artifact", (out / "source.cu").read_text(), gemv_rule)
