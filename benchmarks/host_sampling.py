"""The host's share of a sampled row's step: runtime/sampler.Sampler drawing a token from one
248,192-column logits row (248,077 decodable) and the logprob reported with it.

A row that is not greedy (temperature > 0, no grammar) copies its logits to the host and is
sampled there, every step, before the next step can launch; this is that work per row. Run on
the serving host's CPU (it is numpy only; no GPU, no compiler):

  python benchmarks/host_sampling.py [--out docs/results] [--label NAME]

Rows: a flat one (normal logits, sd 3: a nucleus of thousands of tokens) and a peaked one (sd
12: a small nucleus), each with Qwen3.5's suggested settings (temperature 0.7, top_p 0.8,
top_k 20), top_p 0.9 alone, and plain temperature 1.0. Medians of `--repeats` calls, in ms.
A checkout without `Sampler.logprob` (before it existed) takes the float64 `logprobs(row)[t]`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

DECODABLE, SELECTION = 248_077, 248_192
SETTINGS = {
    "t0.7_p0.8_k20": dict(temperature=0.7, top_p=0.8, top_k=20),
    "t0.7_p0.9": dict(temperature=0.7, top_p=0.9),
    "t1.0": dict(temperature=1.0),
}


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(repeats: int) -> list[dict]:
    from qwen35_tvm.runtime.sampler import Sampler, SamplingParams, make_rng

    sampler = Sampler(DECODABLE)
    rng = np.random.default_rng(0)
    rows = {}
    for name, scale in (("flat", 3.0), ("peaked", 12.0)):
        row = np.full(SELECTION, -np.inf, dtype=np.float32)
        row[:DECODABLE] = rng.normal(0.0, scale, DECODABLE)
        rows[name] = row
    if hasattr(sampler, "logprob"):
        logprob = sampler.logprob
    else:  # an older checkout: the float64 row it computed

        def logprob(row, token):
            return float(sampler.logprobs(row)[token])

    out = []
    for row_name, row in rows.items():
        for name, kwargs in SETTINGS.items():
            params, gen = SamplingParams(**kwargs), make_rng(1)
            token = sampler.sample(row, params, gen)
            draw = _median_ms(lambda: sampler.sample(row, params, gen), repeats)  # noqa: B023
            lp = _median_ms(lambda: logprob(row, token), repeats)  # noqa: B023
            out.append({"row": row_name, "params": name, "sample_ms": draw, "logprob_ms": lp,
                        "total_ms": draw + lp})  # fmt: skip
            print(f"{row_name:7s} {name:14s} sample {draw:6.2f} ms  logprob {lp:5.2f} ms  "
                  f"total {draw + lp:6.2f} ms")  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, default=None, help="also write host_sampling_LABEL.json")
    p.add_argument("--label", default="now")
    args = p.parse_args()
    rows = measure(args.repeats)
    if args.out is not None:
        result = {"machine": platform.processor() or platform.machine(), "numpy": np.__version__,
                  "label": args.label, "rows": rows}  # fmt: skip
        path = args.out / f"host_sampling_{args.label}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {path}")


if __name__ == "__main__":
    main()
