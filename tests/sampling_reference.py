"""schedules/sample_pick.py's draw in numpy: the same counter-based hash and the same float32
steps, so a CPU run of the kernel can be checked token for token."""

from __future__ import annotations

import numpy as np

from qwen35_tvm.schedules.draw_hash import DRAW, MIX
from qwen35_tvm.schedules.nucleus import FIXED, LOG2E
from qwen35_tvm.schedules.sample_pick import K_MAX

U32 = np.uint32


def mix(h):
    """lowbias32's finaliser, as the kernel's `mix`, on a uint32 or an array of them."""
    h = np.asarray(h, dtype=np.uint32).copy()
    with np.errstate(over="ignore"):
        h ^= h >> U32(16)
        h *= U32(MIX[0])
        h ^= h >> U32(15)
        h *= U32(MIX[1])
        h ^= h >> U32(16)
    return h


def row_key(seed_lo: int, seed_hi: int, counter: int) -> int:
    h = int(mix(seed_hi & 0xFFFFFFFF))
    h = int(mix(h ^ (seed_lo & 0xFFFFFFFF)))
    return int(mix(h ^ (counter & 0xFFFFFFFF)))


def uniform(h: np.ndarray) -> np.ndarray:
    return ((np.asarray(h, np.uint32) >> U32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(
        1.0 / (1 << 24)
    )


def column_uniforms(key: int, n: int) -> np.ndarray:
    return uniform(mix(np.uint32(key) ^ np.arange(n, dtype=np.uint32)))


def nucleus_floor(x: np.ndarray, temperature: float, top_p: float) -> float:
    """schedules/nucleus.py's floor of a row's decodable logits x: the least value of the
    smallest most-likely set holding top_p of the fixed-point mass, every tie of it kept."""
    x = x.astype(np.float32)
    t = (x.max() - x) * (np.float32(LOG2E) / np.float32(temperature))
    w = np.floor(np.exp2(-t).astype(np.float64) * FIXED)
    target = np.float64(np.float32(top_p)) * w.sum()
    values, at = np.unique(x[w > 0], return_inverse=True)  # ascending
    from_top = np.cumsum(np.bincount(at, weights=w[w > 0])[::-1])  # integers: exact
    return float(values[::-1][np.searchsorted(from_top, target, side="left")])


def draw(row: np.ndarray, decodable: int, temperature: float, top_p: float, top_k: int,
         seed_lo: int, seed_hi: int, counter: int, min_p: float = 0.0
         ) -> tuple[int, float]:  # fmt: skip
    """The kernel's token and raw logprob for one row."""
    x = row[:decodable].astype(np.float32)
    key = row_key(seed_lo, seed_hi, counter)
    y = x / np.float32(temperature)
    lse = float(np.float64(x.max()) + np.log(np.exp((x - x.max()).astype(np.float64)).sum()))
    if top_k < 1:
        u = column_uniforms(key, decodable)
        noise = -np.log(-np.log1p(-u))
        score = np.where(np.isfinite(x), y + noise, y)
        if top_p < 1.0:
            score = np.where(x >= nucleus_floor(x, temperature, top_p), score, -np.inf)
        if min_p > 0.0:
            score = np.where(np.exp(y - y.max()) < np.float32(min_p), -np.inf, score)
        token = int(np.argmax(score))
        return token, float(x[token]) - lse
    k = min(top_k, K_MAX)
    order = np.lexsort((np.arange(decodable), -y))[:k]  # score down, then id up
    order = order[np.isfinite(y[order])]
    w = np.exp(y[order] - y[order[0]]).astype(np.float32)
    total = np.float32(0)
    for v in w:
        total = np.float32(total + v)
    keep, run = len(w), np.float32(0)
    for q, v in enumerate(w):
        run = np.float32(run + v)
        if run >= np.float32(top_p) * total:
            keep = q + 1
            break
    under = np.flatnonzero(w < np.float32(min_p))  # min_p after top_p: a prefix of the list
    keep = min(keep, int(under[0])) if len(under) else keep
    point = uniform(mix(key ^ DRAW)) * np.float32(w[:keep].sum(dtype=np.float32))
    acc, sel = np.float32(0), 0
    for q in range(keep):
        if w[q] > 0:
            if acc <= point:
                sel = q
            acc = np.float32(acc + w[q])
    token = int(order[sel])
    return token, float(x[token]) - lse
