"""Reading a Hugging Face Qwen3.5 folder: its config and the language model's tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from .config import ConfigError, ModelConfig

# Multimodal checkpoints nest the text tower; the vision tower and the MTP head are not ours.
_PREFIXES = ("model.language_model.", "model.")
_SKIPPED = ("visual.", "model.visual.", "mtp.", "model.mtp.")


class WeightError(ValueError):
    """A checkpoint whose tensors disagree with its config; the message names the tensor."""


class HFModelFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConfigError(f"{self.path}: no config.json (is this a Hugging Face model folder?)")
        self.raw_config = json.loads((self.path / "config.json").read_text())
        self.config = ModelConfig.from_hf(self.raw_config)

    def weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [self.path / name for name in sorted(set(weight_map.values()))]
        single = self.path / "model.safetensors"
        return [single] if single.is_file() else []

    def has_weights(self) -> bool:
        return bool(self.weight_files())

    def _locate(self) -> dict[str, tuple[Path, str]]:
        """Our tensor name (HF name without prefix, or `lm_head.weight`) -> (file, HF key)."""
        found: dict[str, tuple[Path, str]] = {}
        for file in self.weight_files():
            with safe_open(file, framework="numpy") as f:
                for key in f.keys():
                    if key.startswith(_SKIPPED):
                        continue
                    if key == "lm_head.weight":
                        found[key] = (file, key)
                        continue
                    for prefix in _PREFIXES:
                        if key.startswith(prefix):
                            found[key[len(prefix) :]] = (file, key)
                            break
        return found

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.config.weight_shapes()
        if not self.config.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.config.vocab_size, self.config.hidden_size)
        return shapes

    def check(self) -> None:
        """Every tensor the config implies is present."""
        if not self.has_weights():
            raise WeightError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self._located = self._locate()
        missing = sorted(set(self.expected_shapes()) - set(self._located))
        if missing:
            raise WeightError(
                f"{self.path}: missing tensor '{missing[0]}' ({len(missing)} missing)"
            )

    def get(self, name: str) -> np.ndarray:
        """One tensor by its prefix-free name, checked against the shape the config implies."""
        if not hasattr(self, "_located"):
            self.check()
        file, key = self._located[name]
        with safe_open(file, framework="numpy") as f:
            array = f.get_tensor(key)
        expected = self.expected_shapes()[name]
        if tuple(array.shape) != expected:
            raise WeightError(
                f"tensor '{key}' has shape {tuple(array.shape)}, but the config implies {expected}"
            )
        return array


def resolve_model(model: str | Path) -> HFModelFolder:
    """A model folder, or the name of an embedded one (`tiny-random`)."""
    if str(model) == "tiny-random":
        from .random_model import tiny_random_dir

        return HFModelFolder(tiny_random_dir())
    return HFModelFolder(model)
