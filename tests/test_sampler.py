"""Tests for qwen35_tvm.runtime.sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qwen35_tvm.runtime.sampler import (
    _CDF_BLOCK,
    Sampler,
    SamplingParams,
    _inverse_cdf,
    is_effectively_greedy,
    make_rng,
)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 and back (round to nearest even)."""
    x = np.asarray(x, dtype=np.float32)
    try:
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    except ImportError:
        bits = x.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)


def _arena(decodable_logits: np.ndarray, selection: int) -> np.ndarray:
    row = np.full(selection, -np.inf, dtype=np.float32)
    row[: decodable_logits.shape[0]] = decodable_logits
    return row


def _state(rng: np.random.Generator) -> dict:
    return rng.bit_generator.state


# --- routing -------------------------------------------------------------------------------


def test_routing_uses_decodable_not_arena_width() -> None:
    decodable, selection = 256, 512
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 1.0, decodable).astype(np.float32)
    hi = np.float32(10.0)
    lo = np.nextafter(hi, np.float32(-np.inf))  # one fp32 ulp below
    assert hi != lo and _bf16_round(hi) == _bf16_round(lo)  # tied in bf16, not in fp32
    logits[3], logits[7] = lo, hi  # the winner has the higher id
    row = _arena(logits, selection)
    params = SamplingParams(top_p=1.0 / 256)

    assert is_effectively_greedy(params, decodable)
    # Measured on the arena, 1/256 > 1/512 would send the request down the sampling path.
    assert not is_effectively_greedy(params, selection)

    sampler = Sampler(decodable)
    for seed in range(64):
        gen = make_rng(seed)
        before = _state(gen)
        assert sampler.sample(row, params, gen) == 7
        # The greedy path draws nothing; the sampling path would advance the generator.
        assert _state(gen) == before

    gens = [make_rng(s) for s in range(64)]
    before = [_state(g) for g in gens]
    batch = sampler.sample_batch(np.stack([row] * 64), [params] * 64, gens)
    assert (batch == 7).all()
    assert [_state(g) for g in gens] == before


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-5}, True),
        ({"temperature": 2e-5}, False),
        ({"top_k": 1}, True),
        ({"top_k": 2}, False),
        ({"top_p": 1.0 / 1000}, True),
        ({"top_p": 1.001 / 1000}, False),
        ({}, False),
    ],
)
def test_is_effectively_greedy_thresholds(kwargs: dict, greedy: bool) -> None:
    assert is_effectively_greedy(SamplingParams(**kwargs), 1000) is greedy


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1.0"),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_p", math.inf),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", math.nan),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.0),
        ("min_p", math.nan),
        ("min_p", math.inf),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", math.nan),
    ],
)
def test_invalid_params_refused_naming_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 50},
        {"min_p": 0.0},
        {"min_p": 0.999},
        {"seed": None},
        {"seed": 0},
        {"seed": -3},
        {"seed": 2**70},
    ],
)
def test_valid_params_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


# --- pads ----------------------------------------------------------------------------------


def test_greedy_never_returns_pad_when_decodable_logits_very_negative() -> None:
    decodable, selection = 100, 128
    logits = -1e30 * (1.0 + np.random.default_rng(1).random(decodable)).astype(np.float32)
    row = _arena(logits.astype(np.float32), selection)
    sampler = Sampler(decodable)
    greedy = SamplingParams(temperature=0.0)
    tok = sampler.sample(row, greedy, make_rng(0))
    assert tok == int(np.argmax(logits)) and tok < decodable
    assert sampler.sample_batch(row[None, :], [greedy], [make_rng(0)])[0] == tok
    # The sampling path: all-equal very negative logits are uniform over decodable only.
    flat = _arena(np.full(decodable, -1e30, dtype=np.float32), selection)
    gen = make_rng(0)
    draws = {sampler.sample(flat, SamplingParams(), gen) for _ in range(2000)}
    assert max(draws) < decodable and len(draws) > decodable // 2


def test_unmasked_pads_are_still_ignored() -> None:
    # Defence in depth: even if a kernel forgot the mask, pads are outside the support.
    row = np.full(16, 50.0, dtype=np.float32)
    row[:8] = np.linspace(-1.0, 0.0, 8)
    sampler = Sampler(8)
    assert sampler.sample(row, SamplingParams(temperature=0.0), make_rng(0)) == 7
    gen = make_rng(0)
    assert all(sampler.sample(row, SamplingParams(), gen) < 8 for _ in range(500))
    assert sampler.logprobs(row).shape == (8,)


# --- support restriction -------------------------------------------------------------------

# Token id -> probability at temperature 1; the leader deliberately not at id 0.
_PROBS = {5: 0.40, 2: 0.25, 6: 0.15, 0: 0.10, 4: 0.05, 1: 0.03, 3: 0.02}
_DECODABLE, _SELECTION = 7, 16
_DRAWS = 20000


def _probs_row() -> np.ndarray:
    logits = np.zeros(_DECODABLE, dtype=np.float32)
    for tok, p in _PROBS.items():
        logits[tok] = math.log(p)
    return _arena(logits, _SELECTION)


def _frequencies(params: SamplingParams, seed: int = 1234) -> np.ndarray:
    sampler, gen, row = Sampler(_DECODABLE), make_rng(seed), _probs_row()
    counts = np.bincount(
        [sampler.sample(row, params, gen) for _ in range(_DRAWS)], minlength=_SELECTION
    )
    return counts / _DRAWS


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), [5, 2]),
        (SamplingParams(top_k=3), [5, 2, 6]),
        (SamplingParams(top_p=0.7), [5, 2, 6]),  # 0.40 + 0.25 < 0.7 <= 0.80
        (SamplingParams(top_p=0.6), [5, 2]),
        (SamplingParams(top_p=0.3), [5]),
        (SamplingParams(min_p=0.3), [5, 2, 6]),  # keeps p >= 0.12
        (SamplingParams(min_p=0.2), [5, 2, 6, 0]),  # keeps p >= 0.08
        # top_p acts on the top_k survivors renormalised: 0.7 * 0.90 = 0.63 <= 0.40 + 0.25.
        (SamplingParams(top_k=4, top_p=0.7), [5, 2]),
        (SamplingParams(top_k=4, top_p=0.75), [5, 2, 6]),
        (SamplingParams(top_k=4, min_p=0.5), [5, 2]),
        (SamplingParams(), list(_PROBS)),
    ],
)
def test_support_and_renormalised_distribution(params: SamplingParams, allowed: list) -> None:
    freq = _frequencies(params)
    outside = np.setdiff1d(np.arange(_SELECTION), allowed)
    assert freq[outside].sum() == 0.0
    mass = sum(_PROBS[t] for t in allowed)
    for tok in allowed:
        assert freq[tok] == pytest.approx(_PROBS[tok] / mass, abs=0.015), tok


def test_top_k_ties_break_to_lower_id() -> None:
    row = _arena(np.array([0.0, 3.0, 3.0, 3.0, 1.0], dtype=np.float32), 8)
    sampler, gen = Sampler(5), make_rng(0)
    draws = {sampler.sample(row, SamplingParams(top_k=2), gen) for _ in range(500)}
    assert draws == {1, 2}


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scaling(temperature: float) -> None:
    freq = _frequencies(SamplingParams(temperature=temperature))
    scaled = {t: p ** (1.0 / temperature) for t, p in _PROBS.items()}
    total = sum(scaled.values())
    for tok, p in scaled.items():
        assert freq[tok] == pytest.approx(p / total, abs=0.015), tok
    # Colder sharpens the leader above its T=1 probability; hotter flattens it below.
    assert (freq[5] > 0.45) if temperature < 1 else (freq[5] < 0.35)


def test_seeds_reproducible() -> None:
    sampler, row = Sampler(_DECODABLE), _probs_row()
    params = SamplingParams(top_p=0.95, seed=42)

    def run(seed: int) -> list[int]:
        gen = make_rng(seed)
        return [sampler.sample(row, params, gen) for _ in range(200)]

    assert run(42) == run(42)
    assert run(42) != run(43)
    assert run(-42) == run(-42)
    assert run(-42) != run(42)


def test_sample_batch_matches_per_row_sampling() -> None:
    sampler = Sampler(_DECODABLE)
    rows = np.stack([_probs_row()] * 4)
    rows[1, :_DECODABLE] = rows[1, :_DECODABLE][::-1]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.8, min_p=0.1),
    ]
    for seed in range(20):
        got = sampler.sample_batch(rows, params, [make_rng(seed + i) for i in range(4)])
        want = [sampler.sample(rows[i], params[i], make_rng(seed + i)) for i in range(4)]
        assert got.dtype == np.int64 and got.tolist() == want
        assert got[0] == 5 and got[1] == int(np.argmax(rows[1, :_DECODABLE]))


def test_large_arena_top_p() -> None:
    decodable, selection = 248_077, 248_192
    rng = np.random.default_rng(3)
    logits = rng.normal(0.0, 3.0, decodable).astype(np.float32)
    row = _arena(logits, selection)
    sampler = Sampler(decodable)
    lp = sampler.logprobs(row)
    order = np.argsort(-lp, kind="stable")
    cum = np.cumsum(np.exp(lp[order]))
    nucleus = set(order[: int(np.searchsorted(cum, 0.5)) + 1].tolist())
    gen = make_rng(0)
    for _ in range(50):
        assert sampler.sample(row, SamplingParams(top_p=0.5), gen) in nucleus
    tok = sampler.sample(row, SamplingParams(temperature=0.7, top_k=40), gen)
    assert tok in set(order[:40].tolist())


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_normalised_over_decodable() -> None:
    row = _probs_row()
    lp = Sampler(_DECODABLE).logprobs(row)
    assert lp.shape == (_DECODABLE,) and lp.dtype == np.float64
    assert np.exp(lp).sum() == pytest.approx(1.0, abs=1e-12)
    for tok, p in _PROBS.items():
        assert lp[tok] == pytest.approx(math.log(p), abs=1e-6)
    big = _arena(np.random.default_rng(0).normal(0, 5, 1000).astype(np.float32), 1024)
    assert np.exp(Sampler(1000).logprobs(big)).sum() == pytest.approx(1.0, abs=1e-9)


def test_logprob_of_one_token_matches_the_row() -> None:
    """The one-pass float32 logprob a sampled token reports equals the float64 row's entry,
    pads ignored (a 248k arena, an odd width, a row with -inf decodable entries)."""
    rng = np.random.default_rng(5)
    for decodable, selection in [(248_077, 248_192), (1000, 1024), (7, 8)]:
        logits = rng.normal(0, 4, decodable).astype(np.float32)
        logits[rng.integers(0, decodable, decodable // 7 + 1)] = -np.inf
        logits[decodable // 2] = 9.0
        row = _arena(logits, selection)
        row[decodable:] = 50.0  # an unmasked pad would dominate the sum
        sampler = Sampler(decodable)
        full = sampler.logprobs(row)
        for tok in [0, decodable // 2, decodable - 1, int(rng.integers(decodable))]:
            assert sampler.logprob(row, tok) == pytest.approx(full[tok], abs=2e-5), tok
    with pytest.raises(ValueError, match="largest decodable logit"):
        Sampler(3).logprob(np.full(4, -np.inf, dtype=np.float32), 0)


@pytest.mark.parametrize(
    "n", [1, 5, _CDF_BLOCK - 1, _CDF_BLOCK, _CDF_BLOCK + 1, 3 * _CDF_BLOCK + 17]
)
def test_inverse_cdf_matches_a_whole_row_cumsum(n: int) -> None:
    """The two-level draw lands where a float64 cumsum of the whole row would put the same
    point, zero weights (whole empty blocks too) never chosen, block edges included."""
    rng = np.random.default_rng(n)
    q = rng.random(n).astype(np.float32)
    q[rng.random(n) < 0.3] = 0.0
    if n > 2 * _CDF_BLOCK:
        q[_CDF_BLOCK : 2 * _CDF_BLOCK] = 0.0  # an empty block
    q[rng.integers(n)] = 1.0  # some weight
    cum = np.cumsum(q.astype(np.float64))
    us = np.concatenate([[0.0, 1 - 1e-12], rng.random(400)])
    # points at block edges: the running sum at a block's end, over the total
    edges = [cum[e - 1] / cum[-1] for e in range(_CDF_BLOCK, n, _CDF_BLOCK)]
    last = int(np.flatnonzero(q)[-1])
    for u in np.concatenate([us, [e for e in edges if e < 1]]):
        # the first position whose running sum passes the point; past the end (rounding),
        # the last with weight
        want = min(int(np.searchsorted(cum, u * cum[-1], side="right")), last)
        got = _inverse_cdf(q, float(u))
        assert got == want, (u, got, want)
        assert q[got] > 0
    assert _inverse_cdf(q, 1.0) == last  # the point on the total itself


def test_top_logprobs_order_and_ties() -> None:
    row = _arena(np.array([1.0, 3.0, 2.0, 3.0, 0.5, 2.0], dtype=np.float32), 8)
    sampler = Sampler(6)
    lp = sampler.logprobs(row)
    top = sampler.top_logprobs(row, 4)
    assert [t for t, _ in top] == [1, 3, 2, 5]
    assert [v for _, v in top] == pytest.approx([lp[1], lp[3], lp[2], lp[5]])
    assert [t for t, _ in sampler.top_logprobs(row, 1)] == [1]
    assert [t for t, _ in sampler.top_logprobs(row, 3)] == [1, 3, 2]
    assert [t for t, _ in sampler.top_logprobs(row, 100)] == [1, 3, 2, 5, 0, 4]
    assert sampler.top_logprobs(row, 0) == []
