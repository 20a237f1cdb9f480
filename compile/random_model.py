"""Hugging Face-format Qwen3.5 folders with random weights (numpy + safetensors, no torch).

Used for tests and benchmarks when no real checkpoint is at hand. The initialisation keeps the
forward pass non-degenerate: activations stay O(1) through the layers and the logits are
peaked enough that greedy decoding and numerical parity checks are meaningful.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from .config import FULL, LINEAR, ModelConfig

EOS_TOKEN_IDS = (248046, 248044)  # <|im_end|>, <|endoftext|>
VOCAB_SIZE = 248320
# Residual branches scaled by gain/sqrt(2 * layers): the stream ends O(1) at any depth, while the
# layers (not the tied embedding) dominate it, so the logits do not just echo the input token.
_RESIDUAL_GAIN = 3.0
_CHUNK = 1 << 24  # elements generated at once, bounds the float32 scratch to 64 MiB
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _text_shape(
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    linear_k_heads: int,
    linear_v_heads: int,
    tied: bool,
    **overrides: Any,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 256,
        "linear_num_key_heads": linear_k_heads,
        "linear_num_value_heads": linear_v_heads,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "layer_types": [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "eos_token_id": EOS_TOKEN_IDS[1],
    }
    cfg.update(overrides)
    return cfg


SHAPES: dict[str, dict[str, Any]] = {
    "0.8b": _text_shape(1024, 24, 3584, 8, 2, 16, 16, tied=True),
    "2b": _text_shape(2048, 24, 6144, 8, 2, 16, 16, tied=True),
    "4b": _text_shape(2560, 32, 9216, 16, 4, 16, 32, tied=True),
    "9b": _text_shape(4096, 32, 12288, 16, 4, 16, 32, tied=False),
    # The embedded default `tiny-random`: real vocabulary, everything else small.
    "tiny": _text_shape(
        64, 4, 128, 4, 2, 2, 4, tied=True,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=4096,
    ),
}  # fmt: skip

_DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16}


def _np_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes  # a dependency of apache-tvm; safetensors.numpy accepts its bfloat16

        return ml_dtypes.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of bfloat16, float16, float32, got {dtype!r}")
    return _DTYPES[dtype]


def _text_dict(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("model_type") == "qwen3_5":
        text = dict(config["text_config"])
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        text["model_type"] = "qwen3_5_text"
        return text
    return dict(config)


_PATCH_SHAPE = (16, 3, 2, 16, 16)  # Conv3d(3 -> 16, kernel 2x16x16) of the dummy vision tower


def _tensor_specs(cfg: ModelConfig, multimodal: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init kind) of every tensor, in file order."""
    prefix = "model.language_model." if multimodal else "model."
    specs = [(prefix + n, s, _init_kind(n)) for n, s in cfg.weight_shapes().items()]
    if not cfg.tie_word_embeddings:
        specs.append(("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "embed"))
    if multimodal:
        # Stand-ins for the vision tower and the multi-token-prediction head that loaders skip.
        specs.append(("model.visual.patch_embed.proj.weight", _PATCH_SHAPE, "normal"))
        specs.append(("mtp.fc.weight", (cfg.hidden_size, 2 * cfg.hidden_size), "normal"))
    return specs


def _init_kind(name: str) -> str:
    if name == "embed_tokens.weight":
        return "embed"
    if name.endswith("linear_attn.norm.weight"):
        return "gated_norm"  # used as plain w, so centred on 1
    if name.endswith("norm.weight"):
        return "norm"  # (1 + w) RMSNorm, so centred on 0
    if name.endswith("conv1d.weight"):
        return "conv"
    if name.endswith(("A_log", "dt_bias")):
        return name.rsplit(".", 1)[-1]
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
        return "out_proj"
    return "proj"


def _fill(
    rng: np.random.Generator, shape: tuple[int, ...], kind: str, num_layers: int, dtype: Any
) -> np.ndarray:
    n = math.prod(shape)
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    out = np.empty(n, dtype=dtype)
    if kind == "A_log":
        # Decay rates from long to short memory, so the recurrent state actually matters.
        out[:] = rng.uniform(math.log(0.1), math.log(16.0), n)
        return out.reshape(shape)
    mean, std = {
        # Logits = normed hidden . embedding, so std 4/sqrt(hidden) gives logit std ~4.
        "embed": (0.0, 4.0 / math.sqrt(shape[-1])),
        "norm": (0.0, 0.1),
        "gated_norm": (1.0, 0.1),
        "conv": (0.0, 0.15),  # larger makes neighbouring keys so alike that fp32 parity is noise
        "dt_bias": (0.0, 0.5),
        "proj": (0.0, 1.0 / math.sqrt(fan_in)),
        "out_proj": (0.0, _RESIDUAL_GAIN / math.sqrt(fan_in * 2 * num_layers)),
        "normal": (0.0, 0.02),
    }[kind]
    for start in range(0, n, _CHUNK):
        chunk = rng.standard_normal(min(_CHUNK, n - start), dtype=np.float32)
        chunk *= std
        chunk += mean
        out[start : start + chunk.size] = chunk
    return out.reshape(shape)


def _shards(
    specs: list[tuple[str, tuple[int, ...], str]], itemsize: int, shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...], str]]]:
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    used = 0
    for spec in specs:
        size = math.prod(spec[1]) * itemsize
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def _configs(text: dict[str, Any], dtype: str, multimodal: bool) -> dict[str, Any]:
    text = {**text, "dtype": dtype}
    if not multimodal:
        return text
    text.pop("architectures", None)
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5_vision",
            "depth": 1,
            "hidden_size": _PATCH_SHAPE[0],
            "intermediate_size": 32,
            "num_heads": 2,
            "in_channels": _PATCH_SHAPE[1],
            "temporal_patch_size": _PATCH_SHAPE[2],
            "patch_size": _PATCH_SHAPE[3],
            "out_hidden_size": text["hidden_size"],
        },
        "tie_word_embeddings": text["tie_word_embeddings"],
        "dtype": dtype,
    }


def _tensors(
    shard: list[tuple[str, tuple[int, ...], str]], seed: int, num_layers: int, dtype: Any
) -> Iterator[tuple[str, np.ndarray]]:
    for name, shape, kind in shard:
        # One generator per tensor, keyed without the prefix: the values do not depend on
        # sharding, tensor order or whether the folder is multimodal.
        key = name.removeprefix("model.language_model.").removeprefix("model.")
        rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
        yield name, _fill(rng, shape, kind, num_layers, dtype)


def write_random_model(
    config: dict[str, Any],
    out_dir: Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    multimodal: bool = False,
    shard_bytes: int = 2 << 30,
) -> Path:
    """Write a HF Qwen3.5 folder with random weights; one shard is in memory at a time."""
    text = _text_dict(config)
    cfg = ModelConfig.from_hf(text)
    np_dtype = _np_dtype(dtype)
    itemsize = np.dtype(np_dtype).itemsize
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors*"):
        stale.unlink()  # weights of an earlier write with another shard count

    full = _configs(text, dtype, multimodal)
    (out_dir / "config.json").write_text(json.dumps(full, indent=2) + "\n")
    generation = {"eos_token_id": list(EOS_TOKEN_IDS), "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    specs = _tensor_specs(cfg, multimodal)
    shards = _shards(specs, itemsize, shard_bytes)
    total = sum(math.prod(s) for _, s, _ in specs) * itemsize
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="random weights", disable=None) as bar:
        for i, shard in enumerate(shards):
            if len(shards) == 1:
                filename = "model.safetensors"
            else:
                filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors: dict[str, np.ndarray] = {}
            for name, array in _tensors(shard, seed, cfg.num_hidden_layers, np_dtype):
                tensors[name] = array
                weight_map[name] = filename
                bar.update(array.nbytes)
            save_file(tensors, out_dir / filename, metadata={"format": "pt"})
            del tensors  # free the shard before generating the next
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def param_count(config: dict[str, Any]) -> int:
    """Parameters of the language model (embedding and untied head included)."""
    cfg = ModelConfig.from_hf(_text_dict(config))
    return sum(math.prod(s) for _, s, _ in _tensor_specs(cfg, multimodal=False))


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any((folder / f).is_file() for f in _WEIGHT_FILES)


def tiny_random_dir(root: Path | None = None) -> Path:
    """The `tiny` shape (seed 0, float32) in `root`, written once and then re-used."""
    root = Path(root) if root is not None else Path.home() / ".cache" / "qwen35-tvm" / "tiny-random"
    if _complete(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}-"))
    try:
        write_random_model(SHAPES["tiny"], tmp, seed=0, dtype="float32")
        # rename() is atomic and replaces an empty folder; a concurrent writer may win the race.
        os.rename(tmp, root)
    except OSError:
        if not _complete(root):
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return root
