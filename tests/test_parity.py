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


def test_bfloat16_build_is_as_close_to_fp32_as_hf_bfloat16_is(model_root):
    """bf16 weights and activations, prefill then decode. Even a well-conditioned random model
    moves under bf16 rounding (HF's own bf16 run is ~0.012 nat from its fp32 run here), so the
    bound is relative: our bf16 logprobs are no further from the fp32 truth than HF's bf16 ones
    are. Accumulating GEMMs in bf16, for instance, lands several times further."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from qwen35_tvm.compile.build import compile_model
    from qwen35_tvm.compile.random_model import SHAPES, write_random_model

    hf_dir = write_random_model(SHAPES["tiny"], model_root / "hf" / "tiny-bf16", dtype="bfloat16")
    art = compile_model(hf_dir, model_root / "artifacts" / "tiny-bf16", dtype="bfloat16")
    gen = Generator(Artifact(art), prefill_chunk=128)
    hf = {
        dt: Qwen3_5ForCausalLM.from_pretrained(hf_dir, dtype=dt).eval()
        for dt in (torch.bfloat16, torch.float32)
    }
    ours_err, hf_err = [], []
    for length in (7, 65, 200):
        ids = prompt(length + 8, gen.decodable, seed=length)
        ours = log_softmax(gen.logits(ids, decode_from=length), gen.decodable)
        with torch.no_grad():
            ref = {
                dt: log_softmax(m(torch.tensor([ids])).logits[0].float().numpy(), gen.decodable)
                for dt, m in hf.items()
            }
        truth = ref[torch.float32]
        top = np.argsort(-truth, axis=-1)[:, :8]

        def err(x: np.ndarray, top=top, truth=truth) -> np.ndarray:
            return np.abs(np.take_along_axis(x, top, -1) - np.take_along_axis(truth, top, -1))

        ours_err.append(err(ours).ravel())
        hf_err.append(err(ref[torch.bfloat16]).ravel())
    ours_d, hf_d = np.concatenate(ours_err), np.concatenate(hf_err)
    print(
        f"top-8 |dlogprob| vs fp32: ours bf16 mean {ours_d.mean():.3g} "
        f"p99 {np.quantile(ours_d, 0.99):.3g}; HF bf16 mean {hf_d.mean():.3g} "
        f"p99 {np.quantile(hf_d, 0.99):.3g}"
    )
    assert ours_d.mean() <= 1.25 * hf_d.mean()
    assert np.quantile(ours_d, 0.99) <= 1.25 * np.quantile(hf_d, 0.99)


def test_long_prompt_in_chunks_across_pages_then_decode_matches_hf(tiny_compiled):
    """A 4,200-token prompt prefilled in 1,000-token chunks (each ends mid-page), then decode
    steps: the last prompt position and every decode step match HF (float64) within TOL."""
    import torch
    from hf_reference import hf_model

    from qwen35_tvm.runtime.model_runner import ModelRunner

    art = Artifact(tiny_compiled.artifact_dir)
    length, steps, chunk = 4200, 6, 1000
    ids = prompt(length + steps, art.widths.decodable, seed=42)
    runner = ModelRunner(art, max_total_tokens=length + 64)
    runner.add_sequence(0, list(range(runner.pages_per_seq))[::-1])  # pages in reverse order
    for start in range(0, length, chunk):
        last = runner.forward([0], [ids[start : min(start + chunk, length)]])
    rows = [last[-1]] + [runner.forward([0], [[t]])[0] for t in ids[length:-1]]

    model = hf_model(tiny_compiled.hf_dir)
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids[:-1]])).last_hidden_state[0, -steps:]
        ref = model.lm_head(hidden).float().numpy()
    delta = top20_delta(np.stack(rows), ref, art.widths.decodable)
    print(f"L={length} in {chunk}-token chunks + {steps} decode steps: max|dlogprob|={delta:.3g}")
    assert delta <= TOL
