"""How many prompt tokens a step may prefill beside running decodes, from measured costs.

A decode step's time is what every running sequence waits for its next token, so a prefill
chunk that shares the step stretches every running stream's inter-token latency. Instead of a
fixed token count, the chunk is sized by time: the prefill part may take about `share` times a
pure decode step of the same batch. Prefill cost is fitted as `fixed + per_token * n` over recent
chunks (the fixed part, a few ms of kernel launches, is why small chunks are not free), and a
floor of `min_tokens` keeps long prompts moving when even the fixed part exceeds the share.
Where the engine runs a mixed step as one forward (`rows_in_prefill`), the decode rows count as
tokens of that forward, and the whole step may take (1 + share) decode steps. Its rows (decode
rows plus prompt tokens) then fill whole tiles of prefill's GEMMs (`tile_rows`): a row past a
tile reads every weight once more, a step in cost that no line fits (16 decode rows + 112
prompt tokens: 1.74x a decode step; + 113: 2.11x; docs/results/mixed_step_b16_s17.json), so
each tile count's own measured cost caps the step too (`_within_limit`).
"""

from __future__ import annotations

from collections import deque

import numpy as np

# Decode times are kept per batch size; a size never measured borrows the nearest one.
DECODE_EMA = 0.2
# The fewest prompt tokens a mixed step takes by default (serve --mixed-step-min-tokens)
MIN_TOKENS = 128
# serve's default share: a mixed step of about 1.7 decode steps. With mixed steps chained on
# the GPU (their recorded time is GPU time), 1.0 budgets 241-token chunks at 16 rows, 2.1-2.9x
# a decode step; 0.7 keeps them at a 128-row tile (docs/results/serving_*_s18d.json).
MIXED_STEP_SHARE = 0.7


def _update_ema(table: dict[int, float], key: int, seconds: float) -> None:
    old = table.get(key)
    table[key] = seconds if old is None else old + DECODE_EMA * (seconds - old)


class StepCosts:
    def __init__(
        self,
        share: float = 1.0,
        min_tokens: int = MIN_TOKENS,
        window: int = 32,
        rows_in_prefill: bool = False,
        tile_rows: int = 1,
    ) -> None:
        """`rows_in_prefill`: a mixed step is one forward, the decode rows riding in the prefill
        call as one-token chunks (their tokens count in `record_prefill`), so the whole step may
        take (1 + share) decode steps, its rows rounded to whole `tile_rows`."""
        if share <= 0 or min_tokens < 1 or tile_rows < 1:
            raise ValueError(
                f"share {share} must be > 0, min_tokens {min_tokens} and tile_rows {tile_rows}"
                " >= 1"
            )
        self.share = share
        self.rows_in_prefill = rows_in_prefill
        self.tile_rows = tile_rows
        self.min_tokens = min_tokens
        self._decode: dict[int, float] = {}  # batch rows -> EMA of the step's seconds
        self._prefill: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self._tiles: dict[int, float] = {}  # whole tiles of a step's rows -> EMA of its seconds

    def record_decode(self, rows: int, seconds: float) -> None:
        _update_ema(self._decode, rows, seconds)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self._prefill.append((tokens, seconds))
        if self.tile_rows > 1:
            _update_ema(self._tiles, -(-tokens // self.tile_rows), seconds)

    def decode_seconds(self, rows: int) -> float | None:
        if not self._decode:
            return None
        return self._decode[min(self._decode, key=lambda r: abs(r - rows))]

    def prefill_fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds a token) of a prefill chunk, or None before two different
        chunk sizes were seen. A single size gives a line through the origin."""
        if not self._prefill:
            return None
        n = np.array([t for t, _ in self._prefill], dtype=np.float64)
        s = np.array([x for _, x in self._prefill], dtype=np.float64)
        if np.ptp(n) == 0:
            return 0.0, float(s.mean() / n[0])
        per_token, fixed = np.polyfit(n, s, 1)
        if per_token <= 0:  # noise over a narrow range of sizes
            return 0.0, float(s.sum() / n.sum())
        return max(float(fixed), 0.0), float(per_token)

    def prefill_tokens(self, decode_rows: int, most: int, prefilling: int = 0) -> int:
        """Prompt tokens for a step that also decodes `decode_rows` sequences while
        `prefilling` prompts wait for theirs (at most `most`, the fixed chunk, which is also the
        answer while nothing decodes or nothing is known). While prompts outnumber the decodes
        (a burst of arrivals) they get the whole chunk: time to first token is what their
        users wait for, and the few running streams pay a few long steps."""
        if prefilling > decode_rows:
            return most
        step = self.decode_seconds(decode_rows) if decode_rows else None
        fit = self.prefill_fit()
        if step is None or fit is None:
            return most
        fixed, per_token = fit
        budget = self.share * step - fixed
        if self.rows_in_prefill:
            budget += step - per_token * decode_rows  # the rows' own share of the forward
        fits = int(budget / per_token + 1e-6)  # not 79.999 -> 79
        tokens = max(min(fits, most), min(self.min_tokens, most))
        if not self.rows_in_prefill:
            return tokens
        tokens = self._whole_tiles(decode_rows, tokens, most)
        return self._within_limit(decode_rows, tokens, (1 + self.share) * step, most)

    def tile_seconds(self, tiles: int) -> float | None:
        """A step of `tiles` whole tiles of rows: its measured seconds, else those of the
        largest count measured below it, scaled up in proportion (more than a tile more
        costs, so the cap errs towards fewer tiles), else None."""
        if tiles in self._tiles:
            return self._tiles[tiles]
        below = [t for t in self._tiles if t < tiles]
        return self._tiles[max(below)] * tiles / max(below) if below else None

    def _within_limit(self, rows: int, tokens: int, limit: float, most: int) -> int:
        """`tokens` beside `rows` decode rows, a tile fewer while the step's tiles cost more
        than `limit` (measured: tile_seconds) and the tile below leaves at least half the
        floor's tokens. Over the one size steady mixed steps take (a tile) the line's slope is
        noise, and a budget divided by a small slope once gave Poisson traffic two-tile steps
        (1.8-2.2x a decode step; ITL p99 2.3x p50: docs/results/serving_s49_h100)."""
        t = self.tile_rows
        keep = max(1, min(self.min_tokens, most) // 2)
        tiles = -(-(rows + tokens) // t)
        while tiles > 1 and (tiles - 1) * t - rows >= keep:
            cost = self.tile_seconds(tiles)
            if cost is None or cost <= limit:
                break
            tiles -= 1
        return min(tokens, tiles * t - rows)

    def _whole_tiles(self, rows: int, tokens: int, most: int) -> int:
        """`tokens` beside `rows` decode rows, moved to where the step's rows end a GEMM tile:
        down (the tile they spill into costs as much as a full one), unless that leaves fewer
        than half of them (a floor, or a full batch); then up, into the tile they already pay."""
        t = self.tile_rows
        total = rows + tokens
        if tokens >= most or total % t == 0:
            return tokens
        down = total // t * t - rows
        if 2 * down >= tokens:
            return down
        return min(-(-total // t) * t - rows, most)
