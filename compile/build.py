"""`compile` and `convert`: a model folder in, an artifact folder out.

The library is built from the config alone; weights are converted separately (compile runs
conversion too when the folder has weights), so a library built on one machine can get its
weights converted on another.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import tvm
from tvm.relax.frontend import nn

from ..schedules.kv_cache import PAGE_SIZE
from ..schedules.matmul_config import DEFAULT_CONFIG
from .config import ModelConfig
from .convert import convert_weights, log, write_meta
from .cuda_toolchain import prepare_cuda_codegen
from .exports import export_spec, mark_decode_for_cuda_graph, prompts_prefill_differs
from .hf_folder import HFModelFolder, resolve_model
from .model import Qwen35LM
from .pipeline import relax_pipeline, tir_pipeline
from .targets import make_target
from .tokenizer_build import chat_template_of, decodable_width, resolve_tokenizer
from .vocab import VocabWidths

SCHEMA_VERSION = 3  # 3: our own paged KV cache (pools + page table); decode writes into buffers
DTYPES = ("float32", "bfloat16")
DEFAULT_EOS = ("<|im_end|>", "<|endoftext|>")
MAX_DECODE_BATCH = 64  # decode's static storage (and each CUDA graph) is planned for this many


def build_module(
    config: ModelConfig,
    widths: VocabWidths,
    dtype: str,
    target: tvm.target.Target,
    mask_pad: bool = True,
) -> tuple[tvm.IRModule, list[tuple[str, nn.Parameter]]]:
    with target:
        model = Qwen35LM(config, widths, dtype, mask_pad=mask_pad)
        spec = export_spec(config, widths, dtype, prompts_prefill_differs(config, dtype, target))
        mod, named_params, _ = model.export_tvm(spec=spec, allow_extern=True)
    return mark_decode_for_cuda_graph(mod, MAX_DECODE_BATCH), named_params


def compile_model(
    model: str | Path,
    out_dir: str | Path,
    target: str = "llvm",
    arch: str = "sm_80",
    dtype: str = "float32",
    context_window: int | None = None,
    convert: bool = True,
    cuda_graph: bool = True,
    dependent_launch: bool = True,
    _mask_pad: bool = True,
) -> Path:
    """Build the library for `target` and write the artifact folder. On CUDA, `decode` runs as
    CUDA graphs unless `cuda_graph` is off, and our kernels start before their producers end
    (programmatic dependent launch, sm_90) unless `dependent_launch` is off. `_mask_pad=False`
    is a test-only switch that removes the logits pad mask, to prove the mask tests can fail."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    folder = resolve_model(model)
    config = folder.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = resolve_tokenizer(folder.path)
    widths = VocabWidths.resolve(config.vocab_size, decodable_width(tokenizer))
    tvm_target, arches = make_target(target, arch)
    if target == "cuda":
        prepare_cuda_codegen(arches)  # SASS for each arch + PTX, so the GPU host never JITs

    started = time.time()
    log(f"lowering {config.num_hidden_layers} layers to Relax ({target}, {dtype})")
    mod, named_params = build_module(config, widths, dtype, tvm_target, mask_pad=_mask_pad)
    log(f"compiling with TVM {tvm.__version__} ({len(mod.functions)} functions)")
    cuda_graph = cuda_graph and target == "cuda"
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": cuda_graph}):
        executable = tvm.compile(
            mod,
            tvm_target,
            relax_pipeline=relax_pipeline(tvm_target),
            tir_pipeline=tir_pipeline(tvm_target) if dependent_launch else "default",
        )
    executable.export_library(str(out / "model.so"))
    compile_seconds = time.time() - started
    log(f"library built in {compile_seconds:.1f} s")

    tokenizer.save(str(out / "tokenizer.json"))
    template = chat_template_of(folder.path)
    if template is not None:
        (out / "chat_template.jinja").write_text(template)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    # rows of prefill's tensor-core GEMM tiles (bf16 on CUDA): the engine fills a mixed step's
    # rows to whole tiles, since a row past one reads every weight once more
    tile_rows = DEFAULT_CONFIG.block_m if (target, dtype) == ("cuda", "bfloat16") else 1
    meta: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tvm_version": tvm.__version__,
        "target": target,
        "arch": arches,
        "dtype": dtype,
        "vocab": widths.to_dict(),
        "logits_pad_masked": _mask_pad,
        "context_window": context_window or config.max_position_embeddings,
        "max_decode_batch": MAX_DECODE_BATCH,
        "page_size": PAGE_SIZE,
        "prefill_tile_rows": tile_rows,
        "cuda_graph": cuda_graph,
        "dependent_launch": dependent_launch and target == "cuda",
        "eos_token_ids": _eos_ids(folder, tokenizer),
        "params": [
            {"name": name, "shape": [int(s) for s in p.shape], "dtype": p.dtype}
            for name, p in named_params
        ],
        "weights": None,
        "compile_seconds": round(compile_seconds, 2),
    }
    write_meta(out, meta)
    if convert and folder.has_weights():
        convert_weights(folder, out)
    return out


def _eos_ids(folder: HFModelFolder, tokenizer) -> list[int]:
    gen = folder.path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return sorted({eos} if isinstance(eos, int) else set(eos))
    ids = [tokenizer.token_to_id(t) for t in DEFAULT_EOS]
    return sorted(i for i in ids if i is not None)
