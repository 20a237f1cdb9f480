"""Converting a checkpoint's tensors into the artifact's parameters.

Fusions done here, once, instead of at every forward: gate/up, q/k/v and the four GDN
input projections are concatenated; HF's zero-centred RMSNorm weights become (1 + w); a
decoder layer's two norms, each read only by the projection after it, are folded into that
projection's columns, W · diag(1 + w), leaving the model a norm without weight (`FOLDED_NORMS`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from .hf_folder import HFModelFolder, resolve_model

SHARD_BYTES = 1 << 30
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# Norms and GDN decay constants stay float32 whatever the compiled dtype.
_F32_SUFFIXES = ("norm.weight", "layernorm.weight", "A_log", "dt_bias", "norm_weight")


# projection -> the norm before it whose (1 + w) its columns take, where the artifact has no
# parameter of that norm's own (a library built before the fold has one, and keeps it)
FOLDED_NORMS = {
    "linear_attn.in_proj.weight": "input_layernorm.weight",
    "self_attn.qkv_proj.weight": "input_layernorm.weight",
    "mlp.gate_up_proj.weight": "post_attention_layernorm.weight",
}


def _folded_recipe(name: str, params: set[str]) -> tuple[list[str], Callable[..., np.ndarray]]:
    """`_recipe`, with the norm of FOLDED_NORMS folded in where `params` lacks it."""
    sources, combine = _recipe(name)
    for proj, norm in FOLDED_NORMS.items():
        norm_name = name.removesuffix(proj) + norm
        if name.endswith(proj) and norm_name not in params:

            def folded(*xs: np.ndarray, combine=combine) -> np.ndarray:
                return combine(*xs[:-1]) * (1.0 + xs[-1])  # [n, k] * [k]: column j by w_j

            return [*sources, norm_name], folded
    return sources, combine


def _recipe(name: str) -> tuple[list[str], Callable[..., np.ndarray]]:
    """HF tensors behind one of our parameters, and how to combine them (in float32)."""

    def cat(*xs: np.ndarray) -> np.ndarray:
        return np.concatenate(xs, axis=0)

    def one_plus(x: np.ndarray) -> np.ndarray:
        return 1.0 + x

    def same(x: np.ndarray) -> np.ndarray:
        return x

    if name.endswith("mlp.gate_up_proj.weight"):
        p = name.removesuffix("gate_up_proj.weight")
        return [p + "gate_proj.weight", p + "up_proj.weight"], cat
    if name.endswith("self_attn.qkv_proj.weight"):
        p = name.removesuffix("qkv_proj.weight")
        return [p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"], cat
    if name.endswith("linear_attn.in_proj.weight"):
        p = name.removesuffix("in_proj.weight")
        return [p + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")], cat
    if name.endswith("linear_attn.conv_weight"):
        return [name.removesuffix("conv_weight") + "conv1d.weight"], lambda w: w[:, 0, :]
    if name.endswith("linear_attn.norm_weight"):
        return [name.removesuffix("norm_weight") + "norm.weight"], same  # plain w, not 1 + w
    if (
        name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))
        or name == "norm.weight"
    ):
        return [name], one_plus
    return [name], same


def converted_params(
    folder: HFModelFolder, names: list[str], dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
    folder.check()
    params = set(names)
    for name in names:
        sources, combine = _folded_recipe(name, params)
        array = combine(*(folder.get(s).astype(np.float32) for s in sources))
        target = np.float32 if name.endswith(_F32_SUFFIXES) else _DTYPES[dtype]
        yield name, np.ascontiguousarray(array.astype(target))


def write_params(
    folder: HFModelFolder, names: list[str], dtype: str, out_dir: Path
) -> dict[str, dict]:
    """Write shards of at most ~1 GiB; returns {file: {"sha256", "tensors"}}."""
    files: dict[str, dict] = {}
    shard: dict[str, np.ndarray] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if not shard:
            return
        fname = f"params-{len(files):05d}.safetensors"
        save_file(shard, str(out_dir / fname))
        files[fname] = {"sha256": _sha256(out_dir / fname), "tensors": list(shard)}
        shard, size = {}, 0

    for name, array in tqdm(
        converted_params(folder, names, dtype), total=len(names), desc="convert", unit="tensor"
    ):
        if size and size + array.nbytes > SHARD_BYTES:
            flush()
        shard[name] = array
        size += array.nbytes
    flush()
    return files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def log(msg: str) -> None:
    print(f"[qwen35-tvm] {msg}", flush=True)


def convert_weights(model: str | Path | HFModelFolder, artifact_dir: str | Path) -> None:
    """Convert a checkpoint into the parameters an already-built artifact expects. Needs no
    compiler, so it runs where the weights are, not where the library was built."""
    folder = model if isinstance(model, HFModelFolder) else resolve_model(model)
    out = Path(artifact_dir)
    meta = json.loads((out / "artifact.json").read_text())
    resolved = json.loads((out / "config.json").read_text())
    if folder.config.to_dict() != resolved:
        raise ValueError(f"{folder.path}: its config differs from the one {out} was compiled for")
    for old in out.glob("params-*.safetensors"):
        old.unlink()
    log(f"converting weights from {folder.path} to {meta['dtype']}")
    meta["weights"] = write_params(folder, [p["name"] for p in meta["params"]], meta["dtype"], out)
    write_meta(out, meta)


def write_meta(out: Path, meta: dict[str, Any]) -> None:
    tmp = out / "artifact.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    shutil.move(tmp, out / "artifact.json")
