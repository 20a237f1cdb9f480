"""Which engine steps made a serving run's slow inter-token gaps, from `qwen35-tvm bench`'s JSON.

  python benchmarks/itl_timeline.py RESULTS.json [--top 15]

The bench JSON keeps each request's send time and the arrival time of each of its chunks. A step
of the engine delivers a token to every running stream at about the same moment, so arrivals
within `--window` ms of a step's first are that step. Per level this prints the ITL p50/p99,
the gaps before steps that delivered a first token (a prompt finished: a prefill or mixed step)
beside the others', and the slowest steps: when, how long since the step before, how many
streams waited on them, how many of those got their first token, and how many requests were
sent in between. The server's own view is its step histograms (/metrics,
qwen35_engine_step_seconds by kind), which benchmarks/serving.sh saves beside each JSON.
"""

from __future__ import annotations

import argparse
import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np


def steps_of(level: dict[str, Any], window_ms: float) -> list[dict[str, float]]:
    """Arrivals grouped into steps: time (ms from the level's start), streams, first tokens."""
    arrivals = sorted(
        (t, k == 0)
        for r in level["requests"]
        if r["ok"]
        for k, t in enumerate(r["chunk_ms"])
    )
    steps: list[dict[str, float]] = []
    for t, first in arrivals:
        if steps and t - steps[-1]["at"] < window_ms:
            steps[-1]["streams"] += 1
            steps[-1]["firsts"] += first
        else:
            steps.append({"at": t, "streams": 1, "firsts": int(first)})
    return steps


def report(level: dict[str, Any], window_ms: float, top: int) -> None:
    ok = [r for r in level["requests"] if r["ok"]]
    if not ok or "chunk_ms" not in ok[0]:
        print("  no per-chunk times in this JSON (written by a bench from before them)")
        return
    gaps = np.concatenate([np.diff(r["chunk_ms"]) for r in ok])
    p50, p99 = np.percentile(gaps, [50, 99])
    steps = steps_of(level, window_ms)
    sent = np.array(sorted(r["sent_ms"] for r in ok))
    print(f"  ITL p50 {p50:.2f} ms, p99 {p99:.2f} ms ({p99 / p50:.2f}x); {len(steps)} steps")
    rows = []
    for before, step in pairwise(steps):
        gap = step["at"] - before["at"]
        arrived = int(((sent > before["at"]) & (sent <= step["at"])).sum())
        rows.append((gap, step["at"], step["streams"], step["firsts"], arrived))
    for name, pick in (("with a first token", True), ("without", False)):
        g = np.array([r[0] for r in rows if (r[3] > 0) == pick])
        if len(g):
            print(f"  steps {name}: {len(g)}, gap median {np.median(g):.2f} ms, "
                  f"p90 {np.percentile(g, 90):.2f}, max {g.max():.2f}")  # fmt: skip
    print(f"  {'at ms':>9} {'gap ms':>7} {'streams':>7} {'firsts':>6} {'sent':>4}")
    for gap, at, streams, firsts, arrived in sorted(rows, reverse=True)[:top]:
        print(f"  {at:9.1f} {gap:7.2f} {streams:7d} {firsts:6d} {arrived:4d}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--window", type=float, default=2.0, help="ms of arrivals that are one step")
    args = p.parse_args()
    for level in json.loads(args.results.read_text())["results"]:
        rate = "" if level.get("request_rate") is None else f", {level['request_rate']} req/s"
        print(f"concurrency {level['concurrency']}{rate}:")
        report(level, args.window, args.top)


if __name__ == "__main__":
    main()
