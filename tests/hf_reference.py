"""HF transformers as the numerical reference, restricted to the decodable columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, Qwen3_5ForCausalLM

_cache: dict[Path, Qwen3_5ForCausalLM] = {}


def hf_model(path: Path) -> Qwen3_5ForCausalLM:
    if path not in _cache:
        config = AutoConfig.from_pretrained(path)
        config = getattr(config, "text_config", config)
        _cache[path] = Qwen3_5ForCausalLM.from_pretrained(
            path, config=config, dtype=torch.float64
        ).eval()
    return _cache[path]


def hf_logits(path: Path, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].float().numpy()


def log_softmax(logits: np.ndarray, decodable: int) -> np.ndarray:
    """Over the decodable columns only: the checkpoint's pad rows are not tokens."""
    x = logits[..., :decodable].astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def hf_greedy(path: Path, ids: list[int], n: int, decodable: int, rows: int) -> list[int]:
    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            suppress_tokens=list(range(decodable, rows)),
        )
    return out[0, len(ids) :].tolist()
