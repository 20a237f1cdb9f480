"""Hugging Face-format Qwen3.5 folders with random weights (numpy + safetensors, no torch).

Used for tests and benchmarks when no real checkpoint is at hand. The initialisation keeps the
forward pass non-degenerate (logits peaked well above uniform, not echoing the input token) and
well-conditioned: HF's own bfloat16 run stays close to its float32 run, so bf16 parity bounds
measure our kernels rather than how much the random weights amplify rounding.
"""

from __future__ import annotations

import hashlib
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
_CHUNK = 1 << 24  # elements generated at once, bounds the float32 scratch to 64 MiB
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_STAMP = "random-init.json"  # in tiny_random_dir()'s cache: which generator wrote it

# Logits are (final-normed hidden, rms ~1) . (tied embedding row), so an embedding std of
# _LOGIT_STD / sqrt(hidden) gives logits ~ N(0, 1.5^2): the top ones sit below 8, where the bf16
# spacing is 1/32 (rounding HF's bf16 logits alone moves logprobs by ~0.008; the old std of 4 put
# them at ~18, a 0.03 floor), and the top-1 logprob is ~-6.7, far from uniform (-12.4). Small and
# much more peaked cannot both be had: the ~248k other logits sit near 0, so top-1 <= top - 12.4.
_LOGIT_STD = 1.5
# Residual stream: layer 0's MLP writes most of it (rms 0.45, so the tied embedding is a small
# part of the final stream and the logits do not echo the input token) from a nearly exact input,
# and every later branch adds ~1/11 of that. Why: gated products (silu(g) * u; q.k, v and silu(z)
# in GDN) grow a relative error ~1.4x / ~2x per branch, so the old init, whose stream was built up
# evenly over the layers from a small embedding, amplified bf16 rounding ~10x by layer 24 (HF bf16
# vs fp32: 0.27 nat on the top-8 logprobs at 0.8b). What is left is mostly the rounding of the
# bf16 residual adds themselves, ~0.0016 relative each, ~0.011 over 48 adds.
_FIRST_MLP_RMS = 0.45
_BRANCH_RMS = 0.04
_FIRST_MIXER = 0.25  # layer 0's token mixer, relative to the embedding: the MLP input stays ~exact
# rms of what each output projection reads, for unit-variance inputs: silu(g) * u, the gated norm's
# silu(z) * norm(o), and gated attention (softmax averaging over a few keys shrinks it).
_ACT_RMS = {"mlp": 0.6, "gdn": 0.6, "attn": 0.3}
# q_norm / k_norm (1 + w) ~ 1.5: scores get std ~2, so attention picks out a handful of keys even
# at ~1000 tokens. With HF's w = 0 it averages nearly all of them, its output fades with length,
# and a wrong key or KV page would barely show.
_QK_NORM = (0.5, 0.1)


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
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return "qk_norm"
    if name.endswith("norm.weight"):
        return "norm"  # (1 + w) RMSNorm, so centred on 0
    if name.endswith("conv1d.weight"):
        return "conv"
    if name.endswith(("A_log", "dt_bias")):
        return name.rsplit(".", 1)[-1]
    branch = {"down_proj": "mlp", "out_proj": "gdn", "o_proj": "attn"}.get(name.split(".")[-2])
    if branch is not None:
        return f"out_{branch}" + ("0" if name.startswith("layers.0.") else "")
    return "proj"


def _std(kind: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[float, float]:
    """(mean, std) of a normal init; HF's are normal(0, 0.02) for matrices, 0 for (1 + w) norms."""
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    embed_rms = _LOGIT_STD / math.sqrt(cfg.hidden_size)
    if kind.startswith("out_"):
        # Output projections: std = (rms the branch should write) / (rms it reads * sqrt(fan_in)).
        branch, first = kind[4:].rstrip("0"), kind.endswith("0")
        rms = _BRANCH_RMS
        if first:
            rms = _FIRST_MLP_RMS if branch == "mlp" else _FIRST_MIXER * embed_rms
        return 0.0, rms / (_ACT_RMS[branch] * math.sqrt(fan_in))
    return {
        "embed": (0.0, embed_rms),
        # Small spreads around HF's init values, so that every norm tensor and every head's dt
        # differ and a swapped or mis-indexed one shows up in parity.
        "norm": (0.0, 0.1),
        "qk_norm": _QK_NORM,
        "gated_norm": (1.0, 0.1),
        "dt_bias": (1.0, 0.5),
        # Unit gain on the RMS-normed input (HF's 0.02 is that at hidden ~2500).
        "proj": (0.0, 1.0 / math.sqrt(fan_in)),
        "normal": (0.0, 0.02),
    }[kind]


def _fill(
    rng: np.random.Generator, shape: tuple[int, ...], kind: str, cfg: ModelConfig, dtype: Any
) -> np.ndarray:
    n = math.prod(shape)
    out = np.empty(n, dtype=dtype)
    if kind == "A_log":
        # A log-uniform in [1e-3, 16] (HF: uniform in [0.01, 16], nearly every head forgetting
        # within a token or two): a quarter of the heads remember ~80-800 tokens, so long prompts
        # depend on the carried recurrent state.
        out[:] = rng.uniform(math.log(1e-3), math.log(16.0), n)
        return out.reshape(shape)
    if kind == "conv":
        # q/k channels: HF's 0.02 keeps them in silu's linear range, so keys stay isotropic (much
        # above 0.15 made neighbouring keys so alike that fp32 parity was noise). v channels: 0.5,
        # so the core output (~5e-3) is well above the gated norm's sqrt(eps) = 1e-3 and the norm
        # really normalizes, as in a trained model (with 0.02 it would just scale by 1/sqrt(eps)).
        std = np.full((shape[0], 1, 1), 0.02, dtype=np.float32)
        std[2 * cfg.key_dim :] = 0.5
        out[:] = (rng.standard_normal(shape, dtype=np.float32) * std).ravel()
        return out.reshape(shape)
    mean, std = _std(kind, shape, cfg)
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
    shard: list[tuple[str, tuple[int, ...], str]], seed: int, cfg: ModelConfig, dtype: Any
) -> Iterator[tuple[str, np.ndarray]]:
    for name, shape, kind in shard:
        # One generator per tensor, keyed without the prefix: the values do not depend on
        # sharding, tensor order or whether the folder is multimodal.
        key = name.removeprefix("model.language_model.").removeprefix("model.")
        rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
        yield name, _fill(rng, shape, kind, cfg, dtype)


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
            for name, array in _tensors(shard, seed, cfg, np_dtype):
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


def _tiny_stamp() -> str:
    # The digest of this file (init and SHAPES): any edit rewrites the cache once, so a changed
    # init is never silently served from a folder written by an older one.
    try:
        source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    except OSError:
        source = "unknown"
    return json.dumps({"generator": source, "seed": 0, "dtype": "float32"}) + "\n"


def _current(folder: Path, stamp: str) -> bool:
    try:
        return _complete(folder) and (folder / _STAMP).read_text() == stamp
    except OSError:
        return False


def tiny_random_dir(root: Path | None = None) -> Path:
    """The `tiny` shape (seed 0, float32) in `root`, written once and then re-used. A stamp file
    records which version of this module wrote it; a folder from another (or none) is rewritten."""
    root = Path(root) if root is not None else Path.home() / ".cache" / "qwen35-tvm" / "tiny-random"
    stamp = _tiny_stamp()
    if _current(root, stamp):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}-"))
    try:
        write_random_model(SHAPES["tiny"], tmp, seed=0, dtype="float32")
        (tmp / _STAMP).write_text(stamp)
        try:
            # rename() is atomic and replaces an empty folder; a concurrent writer may win the race.
            os.rename(tmp, root)
        except OSError:
            if not root.is_dir():
                raise
            if not _current(root, stamp):
                _replace_files(tmp, root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return root


def _replace_files(new: Path, root: Path) -> None:
    """Move `new`'s files over a stale `root`, stamp last. os.replace() is atomic per file and a
    reader that already opened the old weights keeps them, so concurrent users never see a torn
    file; the folder itself stays in place."""
    for f in root.glob("model*.safetensors*"):
        if not (new / f.name).exists():
            f.unlink(missing_ok=True)  # weights of another shard layout
    for f in sorted(new.iterdir(), key=lambda p: p.name == _STAMP):
        os.replace(f, root / f.name)
