"""The compiled model against HF transformers on the same folder (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import hf_greedy, hf_logits, log_softmax

from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.generate import Generator
from qwen35_tvm.runtime.sampler import SamplingParams

TOL = 2e-4  # nat, on HF's top-20 at every position
LENGTHS = (1, 7, 63, 64, 65, 200)
_generators: dict = {}


def generator_for(compiled) -> Generator:
    if compiled.name not in _generators:
        _generators[compiled.name] = Generator(Artifact(compiled.artifact_dir), prefill_chunk=128)
    return _generators[compiled.name]


def prompt(length: int, decodable: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, decodable, size=length).tolist()


def top20_delta(ours: np.ndarray, ref: np.ndarray, decodable: int) -> float:
    a, b = log_softmax(ours, decodable), log_softmax(ref, decodable)
    top = np.argsort(-b, axis=-1)[:, :20]
    return float(np.abs(np.take_along_axis(a, top, -1) - np.take_along_axis(b, top, -1)).max())


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_logprobs_match_hf(compiled, length):
    gen = generator_for(compiled)
    ids = prompt(length, gen.decodable, seed=length)
    delta = top20_delta(gen.logits(ids), hf_logits(compiled.hf_dir, ids), gen.decodable)
    print(f"{compiled.name} L={length} max|dlogprob|={delta:.3g}")
    assert delta <= TOL


def test_decode_continues_prefill_exactly(compiled):
    """Prefill then one token at a time gives the logprobs of one long prefill."""
    gen = generator_for(compiled)
    ids = prompt(80, gen.decodable, seed=7)
    whole = log_softmax(gen.logits(ids), gen.decodable)
    stepped = log_softmax(gen.logits(ids, decode_from=50), gen.decodable)
    assert np.abs(whole - stepped).max() <= TOL
    delta = top20_delta(
        gen.logits(ids, decode_from=50), hf_logits(compiled.hf_dir, ids), gen.decodable
    )
    assert delta <= TOL


def test_greedy_continuation_matches_hf_generate(compiled):
    gen = generator_for(compiled)
    ids = prompt(12, gen.decodable, seed=3)
    ours = list(gen.generate(ids, SamplingParams(temperature=0.0), 32, stop_ids=[]))
    rows = gen.artifact.widths.rows
    assert ours == hf_greedy(compiled.hf_dir, ids, 32, gen.decodable, rows)
