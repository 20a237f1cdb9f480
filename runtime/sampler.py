"""Token sampling over the logits arena (numpy only).

The compiled model writes logits into an arena of ``selection`` columns of which
only the first ``decodable`` are real tokens; the rest are already ``-inf``.
Every decision here (greedy routing, softmax, support) is made against
``decodable`` so that the arena padding can never change which path a request
takes or which token it gets.

Conventions:
  * ``top_k``: -1 or 0 disables it (the OpenAI/vLLM convention); k >= 1 keeps the
    k most likely tokens, ties broken by lower token id.
  * ``top_p``: nucleus over the probabilities left after ``top_k``; the most likely
    token is always kept.
  * ``min_p``: drops tokens whose probability is below ``min_p`` times the
    probability of the most likely token.
  * Filters apply in the order temperature -> top_k -> top_p -> min_p.
  * The greedy path never draws from the generator, so a request's random stream
    only advances on steps that actually sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "GREEDY_TEMPERATURE",
    "SamplingParams",
    "Sampler",
    "is_effectively_greedy",
    "make_rng",
]

# Temperatures at or below this are treated as argmax (dividing by them would overflow).
GREEDY_TEMPERATURE = 1e-5

# First candidate-set size tried by the nucleus search before falling back to a wider one.
_NUCLEUS_FIRST_K = 256
# Weights a block of the two-level inverse CDF (_inverse_cdf).
_CDF_BLOCK = 1024


def _is_real(value: object) -> bool:
    # bool is an int subclass, but True as a temperature is almost surely a bug.
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; invalid values raise ``ValueError`` at construction."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and its allowed range."""
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not _is_real(p) or not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be a finite number in (0, 1], got {p!r}")
        k = self.top_k
        if not _is_int(k) or k < -1:
            raise ValueError(f"top_k must be an int >= -1 (-1 or 0 disables it), got {k!r}")
        m = self.min_p
        if not _is_real(m) or not math.isfinite(m) or not 0.0 <= m < 1.0:
            raise ValueError(f"min_p must be a finite number in [0, 1), got {m!r}")
        s = self.seed
        if s is not None and not _is_int(s):
            raise ValueError(f"seed must be an int or None, got {s!r}")


def is_effectively_greedy(params: SamplingParams, decodable: int) -> bool:
    """True when sampling could only ever return the argmax over ``decodable`` tokens.

    ``decodable`` must be the real vocabulary width, never the arena width: the
    top token always holds at least 1/decodable of the mass, so a nucleus that
    small keeps exactly one token.
    """
    if decodable <= 0:
        raise ValueError(f"decodable must be >= 1, got {decodable}")
    return (
        params.temperature <= GREEDY_TEMPERATURE
        or params.top_k == 1
        or 0.0 < params.top_p <= 1.0 / decodable
    )


def make_rng(seed: int | None) -> np.random.Generator:
    """Per-request generator: equal seeds give equal draw sequences; None uses OS entropy."""
    if seed is None:
        return np.random.default_rng()
    if seed >= 0:
        return np.random.default_rng(seed)
    # SeedSequence refuses negative entropy; a distinct spawn key keeps -n apart from n.
    return np.random.default_rng(np.random.SeedSequence(-int(seed), spawn_key=(1,)))


def _top_k_ids(values: np.ndarray, k: int) -> np.ndarray:
    """Ascending positions of the k largest values; ties at the cut go to lower positions."""
    n = values.shape[0]
    if k >= n:
        return np.arange(n)
    kth = np.partition(values, n - k)[n - k]
    above = np.flatnonzero(values > kth)
    tied = np.flatnonzero(values == kth)[: k - above.shape[0]]
    return np.sort(np.concatenate([above, tied]))


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Positions of the smallest most-likely prefix of ``p`` holding >= top_p of its mass.

    ``p`` is unnormalised (float32; its sums run in float64). Only a candidate set big enough
    to hold that mass is sorted, so a 248k-wide row rarely pays for a full sort.
    """
    n = p.shape[0]
    target = top_p * float(p.sum(dtype=np.float64))
    k = _NUCLEUS_FIRST_K
    while True:
        if k >= n:
            cand = np.arange(n)
            break
        # Keep every value tied with the k-th so the cut below sees all ties.
        kth = np.partition(p, n - k)[n - k]
        cand = np.flatnonzero(p >= kth)
        if float(p[cand].sum(dtype=np.float64)) >= target:
            break
        k *= 16
    # cand is ascending, so a stable sort breaks ties by lower position (= lower token id).
    order = cand[np.argsort(-p[cand], kind="stable")]
    cum = np.cumsum(p[order], dtype=np.float64)
    cut = int(np.searchsorted(cum, target, side="left")) + 1
    return order[: max(1, min(cut, order.shape[0]))]


def _inverse_cdf(q: np.ndarray, u: float) -> int:
    """The position where the running sum of the weights ``q`` (float32, >= 0, some > 0) first
    exceeds ``u`` (in [0, 1)) times their total: a draw from ``q``.

    Blocks of _CDF_BLOCK weights are summed, and only the block holding the point gets a
    running sum, in float64 (a float64 cumsum of a whole 248k row took ~1.2 ms)."""
    starts = np.arange(0, q.shape[0], _CDF_BLOCK)
    whole = q.shape[0] // _CDF_BLOCK * _CDF_BLOCK  # the last block may be short
    sums = q[:whole].reshape(-1, _CDF_BLOCK).sum(axis=1, dtype=np.float64)
    if whole < q.shape[0]:
        sums = np.append(sums, q[whole:].sum(dtype=np.float64))
    blocks = np.cumsum(sums)
    point = u * blocks[-1]
    # side="right" skips zero-probability entries (and empty blocks)
    b = int(np.searchsorted(blocks, point, side="right"))
    if b >= len(blocks):  # the point rounded onto the total: the last block with weight
        b = int(np.flatnonzero(np.diff(blocks, prepend=0.0) > 0)[-1])
    base = blocks[b - 1] if b else 0.0
    block = q[starts[b] : starts[b] + _CDF_BLOCK]
    j = int(np.searchsorted(base + np.cumsum(block, dtype=np.float64), point, side="right"))
    if j >= len(block):  # rounding past the block's end: its last position with weight
        j = int(np.flatnonzero(block)[-1])
    return int(starts[b]) + j


class Sampler:
    """Samples token ids from rows of the logits arena."""

    def __init__(self, decodable: int) -> None:
        if not _is_int(decodable) or decodable < 1:
            raise ValueError(f"decodable must be an int >= 1, got {decodable!r}")
        self.decodable = int(decodable)

    def _row(self, logits: np.ndarray) -> np.ndarray:
        if logits.ndim != 1 or logits.shape[0] < self.decodable:
            raise ValueError(
                f"expected one row of at least {self.decodable} columns, got shape {logits.shape}"
            )
        # Slice rather than trust the kernel's mask: pads can then never be chosen.
        return logits[: self.decodable]

    def sample(self, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
        """Draw one token id from a row of ``selection`` columns."""
        row = self._row(np.asarray(logits))
        if is_effectively_greedy(params, self.decodable):
            return int(np.argmax(row))
        return self._draw(row, params, rng)

    def _draw(self, row: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
        # float32 elementwise work over the ~248k columns (float64 took ~2.5x as long on the
        # host, which a sampled row waits for every step); sums and cumsums run in float64
        x = row.astype(np.float32)  # a copy: the row may be the caller's
        if params.temperature != 1.0:
            x /= np.float32(params.temperature)
        ids: np.ndarray | None = None  # token id of each position of x; None = identity
        if 0 < params.top_k < x.shape[0]:
            ids = _top_k_ids(x, params.top_k)
            x = x[ids]
        peak = float(x.max())
        if not math.isfinite(peak):
            raise ValueError(f"cannot sample: largest decodable logit is {peak}")
        p = np.exp(x - peak)  # the top token gets exactly 1.0
        keep: np.ndarray | None = None  # positions into p still allowed
        if params.top_p < 1.0:
            keep = _nucleus(p, params.top_p)
        if params.min_p > 0.0:
            # Probabilities are relative to the top token (1.0), so no renormalising needed.
            if keep is None:
                keep = np.flatnonzero(p >= params.min_p)
            else:
                keep = keep[p[keep] >= params.min_p]
        q = p if keep is None else p[keep]
        j = _inverse_cdf(q, rng.random())
        pos = j if keep is None else int(keep[j])
        return pos if ids is None else int(ids[pos])

    def sample_batch(
        self,
        logits: np.ndarray,
        params: list[SamplingParams],
        rngs: list[np.random.Generator],
    ) -> np.ndarray:
        """Sample one token per row of a ``[B, selection]`` array; returns int64 ``[B]``."""
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[1] < self.decodable:
            raise ValueError(f"expected [B, >= {self.decodable}] logits, got shape {logits.shape}")
        b = logits.shape[0]
        if len(params) != b or len(rngs) != b:
            raise ValueError(f"need {b} params and rngs, got {len(params)} and {len(rngs)}")
        out = np.empty(b, dtype=np.int64)
        greedy = np.array([is_effectively_greedy(p, self.decodable) for p in params], dtype=bool)
        if greedy.all():
            return np.argmax(logits[:, : self.decodable], axis=1).astype(np.int64)
        if greedy.any():
            rows = np.flatnonzero(greedy)
            out[rows] = np.argmax(logits[rows, : self.decodable], axis=1)
        for i in np.flatnonzero(~greedy):
            out[i] = self._draw(logits[i, : self.decodable], params[i], rngs[i])
        return out

    def logprobs(self, logits_row: np.ndarray) -> np.ndarray:
        """float64 log_softmax over the decodable columns (raw logits, no temperature)."""
        x = self._row(np.asarray(logits_row)).astype(np.float64)
        peak = float(x.max())
        if not math.isfinite(peak):
            raise ValueError(f"cannot normalise: largest decodable logit is {peak}")
        x -= peak
        x -= math.log(float(np.exp(x).sum()))
        return x

    def _normalised(self, logits_row: np.ndarray) -> tuple[np.ndarray, float]:
        """The decodable columns as float32 and their log-sum-exp, in one float32 pass (its sum
        in float64): what every sampled token's logprob needs, without a float64 row."""
        x = self._row(np.asarray(logits_row)).astype(np.float32, copy=False)
        peak = x.max()
        if not math.isfinite(float(peak)):
            raise ValueError(f"cannot normalise: largest decodable logit is {float(peak)}")
        return x, float(peak) + math.log(float(np.exp(x - peak).sum(dtype=np.float64)))

    def logprob(self, logits_row: np.ndarray, token: int) -> float:
        """``logprobs(logits_row)[token]`` to ~1e-6, in one float32 pass: what a sampled
        token reports every step (equal to its entry in ``top_logprobs``)."""
        x, lse = self._normalised(logits_row)
        return float(x[token]) - lse

    def top_logprobs(self, logits_row: np.ndarray, k: int) -> list[tuple[int, float]]:
        """The k most likely ``(token_id, logprob)`` pairs, descending, ties by lower id."""
        if k <= 0:
            return []
        x, lse = self._normalised(logits_row)
        ids = _top_k_ids(x, k)
        ids = ids[np.lexsort((ids, -x[ids]))]
        return [(int(i), float(x[i]) - lse) for i in ids]
