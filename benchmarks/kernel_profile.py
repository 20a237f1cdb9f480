"""Where a forward's time goes: every VM call timed with a device sync around it.

  on the GPU:  python benchmarks/kernel_profile.py ARTIFACT_DIR [--prompt 1024] [--batch 1,16]

The artifact must have weights (see engine_throughput.py, which leaves one in its WORK dir).
Syncing around each call adds ~10 µs per call, so totals run above real step times; the
ranking is what this is for. Prints the top calls of a prefill and of decode steps as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np


def profile(runner, fn, top: int = 15) -> dict:
    """Runs `fn` once with every VM call timed; returns total ms and the top calls by time."""
    dev = runner.device
    spent: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    started: list[float] = []

    def instrument(func, symbol, before, ret, *args):
        dev.sync()
        if before:
            started.append(time.perf_counter())
        else:
            spent[symbol] += time.perf_counter() - started.pop()
            count[symbol] += 1
        return 0

    runner._vm.set_instrument(instrument)
    try:
        dev.sync()
        t0 = time.perf_counter()
        fn()
        dev.sync()
        total = time.perf_counter() - t0
    finally:
        runner._vm.set_instrument(None)
    ranked = sorted(spent.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": total * 1e3,
        "calls": sum(count.values()),
        "top": [{"symbol": s[:90], "ms": round(t * 1e3, 3), "calls": count[s]} for s, t in ranked],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--batch", default="1,16")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.model_runner import ModelRunner

    batches = [int(b) for b in args.batch.split(",")]
    artifact = Artifact(args.artifact, device=args.device)
    per_seq = 2 * args.prompt + 64  # a profiled prefill runs twice on sequence 0
    runner = ModelRunner(
        artifact, max_batch_size=max(batches), max_total_tokens=max(batches) * per_seq
    )
    pages = -(-per_seq // artifact.page_size)
    rng = np.random.default_rng(0)
    report = {}
    for b in batches:
        ids = list(range(b))
        for i in ids:
            runner.add_sequence(i, list(range(i * pages, (i + 1) * pages)))
        prompts = [rng.integers(1000, 100000, args.prompt).tolist() for _ in ids]
        runner.forward(ids[:1], prompts[:1])  # warm-up (kernel loading)
        runner.forward(ids[:1], [[1]])
        for i in ids[1:]:
            runner.forward([i], [prompts[i]])
        if b == batches[0]:
            report["prefill"] = profile(runner, partial(runner.forward, [0], prompts[:1]))
        step = partial(runner.forward, ids, [[1]] * b)
        step()
        report[f"decode_b{b}"] = profile(runner, step)
        for i in ids:
            runner.remove_sequence(i)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
