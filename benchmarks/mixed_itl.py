"""Inter-token latency of running decodes while prompts arrive: serving's c16 traffic on the
Engine itself, no HTTP, each token labelled with the kind of step that made it.

  here:        python benchmarks/engine_throughput.py build DIR    (the libraries)
  on the GPU:  python benchmarks/mixed_itl.py DIR WORK [--variants graphs] [--out FILE]

A closed loop as `benchmarks/serving.sh` runs it at concurrency 16: `concurrency` requests of
random `prompt`-token prompts and `output` greedy tokens (EOS ignored) start together, and each
one that ends is replaced by a new one until `requests` have run. The engine is built as
`qwen35-tvm serve` builds it (mixed steps sized by time, runtime/step_costs.py). For each
token the host reads, the gap since the same request's previous token, and the step that made
it: "decode", "mixed" (decode rows beside prompt chunks) or "prefill". Issue 12 asks ITL p99
<= 2x p50; this says whether the p99 steps are mixed steps and how far their ITL exceeds what
a mixed step costs the GPU (`profile_step.py --mixed`), without the server's share of it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

PROMPT, OUTPUT, CONCURRENCY, REQUESTS = 1024, 256, 16, 32


def closed_loop(engine, rng, concurrency: int, requests: int, prompt: int, output: int) -> dict:
    """Run the loop; per token: (request, gap ms, step kind, prompt tokens of that step)."""
    from qwen35_tvm.runtime.sampler import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    high = min(100000, engine.decodable)  # engine_throughput's ids, within a small vocabulary

    def submit() -> int:
        ids = rng.integers(min(1000, high // 2), high, prompt).tolist()
        return engine.submit(ids, greedy, output, ignore_eos=True)

    last: dict[int, float] = {}
    started = {submit(): time.perf_counter() for _ in range(concurrency)}
    submitted, gaps, steps = concurrency, [], defaultdict(int)
    first_token_ms = []
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        info = engine.last_step
        kind = info.kind if info is not None else "none"
        if outs:
            steps[kind] += 1
        for out in outs:
            rid = out.request_id
            if rid in last:
                gaps.append((rid, 1e3 * (now - last[rid]), kind, info.prompt_tokens if info else 0))
            else:
                first_token_ms.append(1e3 * (now - started[rid]))
            last[rid] = now
            if out.finish_reason is not None and submitted < requests:
                started[submit()] = time.perf_counter()
                submitted += 1
    return {"gaps": gaps, "steps": dict(steps), "ttft_ms": first_token_ms}


def summarise(loop: dict) -> dict:
    """ITL percentiles overall and by step kind; what the p99's tokens came from."""
    itl = np.array([g for _, g, _, _ in loop["gaps"]])
    kinds = np.array([k for _, _, k, _ in loop["gaps"]])
    p50, p99 = np.percentile(itl, 50), np.percentile(itl, 99)
    by_kind = {
        k: {
            "tokens": int((kinds == k).sum()),
            "itl_ms_mean": float(itl[kinds == k].mean()),
            "itl_ms_p50": float(np.percentile(itl[kinds == k], 50)),
            "itl_ms_p99": float(np.percentile(itl[kinds == k], 99)),
        }
        for k in sorted(set(kinds.tolist()))
    }
    tail = itl >= p99
    tokens_at = defaultdict(int)
    for (_, _, k, n), t in zip(loop["gaps"], tail, strict=True):
        if t:
            tokens_at[f"{k}:{n}"] += 1
    return {
        "tokens": len(itl),
        "itl_ms_p50": float(p50),
        "itl_ms_p99": float(p99),
        "p99_over_p50": float(p99 / p50),
        "itl_ms_max": float(itl.max()),
        "by_step_kind": by_kind,
        # "kind:prompt tokens of the step" -> tokens at or past the p99
        "p99_tail_from": dict(sorted(tokens_at.items(), key=lambda kv: -kv[1])),
        "steps": loop["steps"],
        "ttft_ms_p50": float(np.percentile(loop["ttft_ms"], 50)),
        "ttft_ms_max": float(np.max(loop["ttft_ms"])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path, help="engine_throughput.py's build DIR")
    p.add_argument("work", type=Path, help="where the artifacts with weights go")
    p.add_argument("--shape", default="4b")
    p.add_argument("--variants", default="graphs")
    p.add_argument("--concurrency", type=int, default=CONCURRENCY)
    p.add_argument("--requests", type=int, default=REQUESTS)
    p.add_argument("--prompt", type=int, default=PROMPT)
    p.add_argument("--output", type=int, default=OUTPUT)
    p.add_argument("--share", type=float, default=None, help="mixed-step share (serve's default)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    import torch
    from engine_throughput import _artifacts

    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.engine import Engine
    from qwen35_tvm.runtime.step_costs import MIXED_STEP_SHARE

    share = args.share or MIXED_STEP_SHARE
    names = args.variants.split(",")
    dirs = _artifacts(args.dir, args.work, args.shape, names)
    results: dict = {"device": torch.cuda.get_device_name(), "mixed_step_share": share}
    for name in names:
        c = args.concurrency
        engine = Engine(Artifact(dirs[name], device="cuda"), max_batch_size=c,
                        max_total_tokens=c * (args.prompt + args.output + 64),
                        mixed_step_share=share)  # fmt: skip
        rng = np.random.default_rng(0)
        closed_loop(engine, rng, 2, 2, 64, 8)  # loads every kernel
        loop = closed_loop(engine, rng, c, args.requests, args.prompt, args.output)
        results[name] = summarise(loop)
        print(name, json.dumps(results[name]), flush=True)
        del engine
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
