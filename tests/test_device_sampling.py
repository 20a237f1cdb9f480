"""Sampled requests drawn on the device (runtime/device_sampling.py, CPU fp32): the engine's
tokens equal tests/sampling_reference.py's draws on the sequence's own logits at each position,
with steps launched ahead as greedy ones are; a seeded request draws the same tokens alone or
beside others; settings the kernel does not serve stay with the host's sampler."""

from __future__ import annotations

import numpy as np
import pytest
from sampling_reference import draw
from test_engine import GREEDY, loaded, prompt
from test_launch_ahead_engine import _run

from qwen35_tvm.runtime.device_sampling import DEVICE_TOP_K, drawn_on_device, seed_words
from qwen35_tvm.runtime.model_runner import ModelRunner
from qwen35_tvm.runtime.sampler import SamplingParams
from qwen35_tvm.runtime.sequence import Request
from qwen35_tvm.schedules.sample_pick import K_MAX

SUGGESTED = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=5)  # Qwen3.5's
GUMBEL = SamplingParams(temperature=1.2, seed=-9)  # no top_k, no top_p: the whole row
NUCLEUS = SamplingParams(temperature=0.9, top_p=0.9, seed=3)  # top_p alone (OpenAI clients')
MIN_P = SamplingParams(temperature=1.1, min_p=0.1, seed=4)


def test_the_runtime_knows_the_kernels_top_k():
    assert DEVICE_TOP_K == K_MAX


@pytest.mark.parametrize(
    "params, on_device",
    [
        (SUGGESTED, True),
        (GUMBEL, True),
        (SamplingParams(temperature=1.0, top_k=K_MAX), True),
        (SamplingParams(temperature=1.0, top_k=K_MAX + 1), False),
        (SamplingParams(temperature=1.0, top_p=0.9), True),  # a nucleus of the whole row
        (SamplingParams(temperature=1.0, top_p=0.9, top_k=9), True),  # top_p over the top_k
        (SamplingParams(temperature=1.0, top_k=20, min_p=0.1), True),
        (SamplingParams(temperature=0.8, min_p=0.05), True),  # min_p over the whole row
        (SamplingParams(temperature=0.0, top_k=20), False),  # greedy: the plain pick
        (SamplingParams(temperature=1.0, top_k=1), False),
    ],
)
def test_which_settings_are_drawn_on_the_device(params, on_device):
    assert drawn_on_device(params, 1000, nucleus=True) is on_device
    # an artifact without `sampled_pick_nucleus` leaves top_p without top_k, and min_p, to the
    # host
    newer = (params.top_p < 1.0 and params.top_k < 1) or params.min_p > 0.0
    assert drawn_on_device(params, 1000, nucleus=False) is (on_device and not newer)


def reference_tokens(art, prompt_ids: list[int], params: SamplingParams, n: int) -> list[int]:
    """The draws a request should get: the kernel's draw, in numpy, on the logits of its own
    sequence, position by position (a runner of its own, rows read on the host)."""
    runner = ModelRunner(art, max_batch_size=1, max_total_tokens=1024, num_slots=1)
    runner.add_sequence(0, list(range(32)))
    lo, hi = seed_words(params.seed)
    row = runner.prefill([0], [prompt_ids], np.array([len(prompt_ids) - 1])).rows()[0]
    out = []
    for _ in range(n):
        at = len(prompt_ids) + len(out)  # the position of the token drawn
        token, _ = draw(row, art.widths.decodable, params.temperature, params.top_p,
                        params.top_k, lo, hi, at, params.min_p)  # fmt: skip
        out.append(token)
        row = runner.decode([0], [token]).rows()[0]
    return out


def test_engine_draws_equal_the_reference_and_launch_ahead(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    d = gen.decodable
    reqs = [
        Request(prompt(9, d, 1), SUGGESTED, 14, ignore_eos=True),
        Request(prompt(21, d, 2), GREEDY, 10, ignore_eos=True),
        Request(prompt(5, d, 3), GUMBEL, 14, ignore_eos=True),
        Request(prompt(17, d, 7), NUCLEUS, 14, ignore_eos=True),
        Request(prompt(11, d, 8), MIN_P, 14, ignore_eos=True),
    ]
    want, _ = _run(art, {0: reqs}, overlap=False)
    got, launched = _run(art, {0: reqs}, overlap=True)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    for i in (0, 2, 3, 4):
        assert got[i][0] == reference_tokens(art, reqs[i].prompt_ids, reqs[i].params, 14)
    # before, a sampled row made every step synchronous: now they chain, fed on the device
    assert launched.count(None) >= 8, launched


def test_a_seeded_request_draws_the_same_alone_or_beside_others(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    d = gen.decodable
    mine = Request(prompt(12, d, 4), SUGGESTED, 12, ignore_eos=True)
    other = Request(prompt(30, d, 5), SamplingParams(temperature=1.0, top_k=5, seed=1), 9,
                    ignore_eos=True)  # fmt: skip
    alone, _ = _run(art, {0: [mine]}, overlap=True)
    beside, _ = _run(art, {0: [other], 3: [mine]}, overlap=True)
    assert beside[1][0] == alone[0][0]
    again, _ = _run(art, {0: [mine]}, overlap=True)
    assert again[0][0] == alone[0][0]


def test_settings_the_kernel_does_not_serve_stay_on_the_host(tiny_compiled):
    art, gen = loaded(tiny_compiled)
    d = gen.decodable
    wide = SamplingParams(temperature=1.0, top_k=K_MAX + 1, seed=3)
    reqs = [Request(prompt(7, d, 6), wide, 8, ignore_eos=True)]
    got, launched = _run(art, {0: reqs}, overlap=True)
    assert len(got[0][0]) == 8 and all(0 <= t < d for t in got[0][0])
    assert None not in launched  # the host supplies every token: nothing fed on the device
