"""`compile` and `convert`: a model folder in, an artifact folder out.

The library is built from the config alone; weights are converted separately (compile runs
conversion too when the folder has weights), so a library built on one machine can get its
weights converted on another.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import tvm
from tvm.relax.frontend import nn

from .config import ModelConfig
from .convert import write_params
from .hf_folder import HFModelFolder
from .model import Qwen35LM, export_spec
from .targets import make_target
from .tokenizer_build import chat_template_of, decodable_width, resolve_tokenizer
from .vocab import VocabWidths

SCHEMA_VERSION = 1
DTYPES = ("float32", "bfloat16")
DEFAULT_EOS = ("<|im_end|>", "<|endoftext|>")


def resolve_model(model: str | Path) -> HFModelFolder:
    """A model folder, or the name of an embedded one (`tiny-random`)."""
    if str(model) == "tiny-random":
        from .random_model import tiny_random_dir

        return HFModelFolder(tiny_random_dir())
    return HFModelFolder(model)


def _log(msg: str) -> None:
    print(f"[qwen35-tvm] {msg}", flush=True)


def build_module(
    config: ModelConfig,
    widths: VocabWidths,
    dtype: str,
    target: tvm.target.Target,
    mask_pad: bool = True,
) -> tuple[tvm.IRModule, list[tuple[str, nn.Parameter]]]:
    with target:
        model = Qwen35LM(config, widths, dtype, mask_pad=mask_pad)
        mod, named_params, _ = model.export_tvm(spec=export_spec(config, dtype), allow_extern=True)
    return mod, named_params


def compile_model(
    model: str | Path,
    out_dir: str | Path,
    target: str = "llvm",
    arch: str = "sm_80",
    dtype: str = "float32",
    context_window: int | None = None,
    convert: bool = True,
    _mask_pad: bool = True,
) -> Path:
    """Build the library for `target` and write the artifact folder. `_mask_pad=False` is a
    test-only switch that removes the logits pad mask, to prove the mask tests can fail."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    folder = resolve_model(model)
    config = folder.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = resolve_tokenizer(folder.path)
    widths = VocabWidths.resolve(config.vocab_size, decodable_width(tokenizer))
    tvm_target, arches = make_target(target, arch)

    started = time.time()
    _log(f"lowering {config.num_hidden_layers} layers to Relax ({target}, {dtype})")
    mod, named_params = build_module(config, widths, dtype, tvm_target, mask_pad=_mask_pad)
    _log(f"compiling with TVM {tvm.__version__} ({len(mod.functions)} functions)")
    executable = tvm.compile(mod, tvm_target)
    executable.export_library(str(out / "model.so"))
    compile_seconds = time.time() - started
    _log(f"library built in {compile_seconds:.1f} s")

    tokenizer.save(str(out / "tokenizer.json"))
    template = chat_template_of(folder.path)
    if template is not None:
        (out / "chat_template.jinja").write_text(template)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    meta: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tvm_version": tvm.__version__,
        "target": target,
        "arch": arches,
        "dtype": dtype,
        "vocab": widths.to_dict(),
        "logits_pad_masked": _mask_pad,
        "context_window": context_window or config.max_position_embeddings,
        "eos_token_ids": _eos_ids(folder, tokenizer),
        "params": [
            {"name": name, "shape": [int(s) for s in p.shape], "dtype": p.dtype}
            for name, p in named_params
        ],
        "weights": None,
        "compile_seconds": round(compile_seconds, 2),
    }
    _write_meta(out, meta)
    if convert and folder.has_weights():
        convert_weights(folder, out)
    return out


def convert_weights(model: str | Path | HFModelFolder, artifact_dir: str | Path) -> None:
    """Convert a checkpoint into the parameters an already-built artifact expects."""
    folder = model if isinstance(model, HFModelFolder) else resolve_model(model)
    out = Path(artifact_dir)
    meta = json.loads((out / "artifact.json").read_text())
    resolved = json.loads((out / "config.json").read_text())
    if folder.config.to_dict() != resolved:
        raise ValueError(f"{folder.path}: its config differs from the one {out} was compiled for")
    for old in out.glob("params-*.safetensors"):
        old.unlink()
    _log(f"converting weights from {folder.path} to {meta['dtype']}")
    meta["weights"] = write_params(folder, [p["name"] for p in meta["params"]], meta["dtype"], out)
    _write_meta(out, meta)


def _eos_ids(folder: HFModelFolder, tokenizer) -> list[int]:
    gen = folder.path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return sorted({eos} if isinstance(eos, int) else set(eos))
    ids = [tokenizer.token_to_id(t) for t in DEFAULT_EOS]
    return sorted(i for i in ids if i is not None)


def _write_meta(out: Path, meta: dict[str, Any]) -> None:
    tmp = out / "artifact.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    shutil.move(tmp, out / "artifact.json")
