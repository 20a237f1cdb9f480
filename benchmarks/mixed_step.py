"""What a mixed step costs against a pure decode step: the prefill-chunk sizes a step beside
running decodes can afford (runtime/step_costs.py sizes them by time).

  on the GPU:  python benchmarks/mixed_step.py ARTIFACT_DIR [--batch 16] [--out docs/results]

ARTIFACT_DIR is an artifact with weights (engine_throughput.py leaves one per variant in its
WORK dir). `batch` sequences of `context` random tokens are prefilled; then, with host time
included (each call ends by reading its picks, as the engine's steps do), the table times a
pure decode step of the batch and, for each chunk size n, a mixed step both ways: one forward
(the decode rows ride in the prefill call as one-token chunks: the engine's default) and split
(a decode call, then a prefill call of n tokens). The chunk is a new prompt's first each time
(its slot is reset, inside the timing, both ways). Each time is the median of `repeats`.

The GPU check first: twin sequences (the same prompts in other slots) step twice, one set as a
mixed step's decode rows beside a prompt chunk, the other by decode calls; their logits must
agree within bf16 noise (a mixed step's one-token rows take decode's GDN kernel, and the chunked
kernels skip them: a row updated twice or never shows at the second step).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def check_mixed_rows(art, b: int, context: int, chunk: int, rng) -> dict:
    """Largest |logit difference| over the largest |logit|, and argmax agreement, between
    decode rows stepped inside mixed steps and their twins stepped by decode calls, per step."""
    from qwen35_tvm.runtime.model_runner import ModelRunner

    pages = -(-(context + 4) // art.page_size)
    fresh = -(-chunk // art.page_size)
    runner = ModelRunner(art, max_batch_size=b, max_total_tokens=(2 * b * pages + 2 * fresh)
                         * art.page_size, num_slots=2 * b + 1)  # fmt: skip
    mixed, twins, prompt = list(range(b)), list(range(b, 2 * b)), 2 * b
    for s in mixed + twins:
        runner.add_sequence(s, list(range(s * pages, (s + 1) * pages)))
    for s in mixed:
        tokens = rng.integers(1000, 100000, context).tolist()
        for t in (s, s + b):
            runner.prefill([t], [tokens], np.array([context - 1]))
    steps, at = [], 2 * b * pages
    for step in range(2):
        runner.add_sequence(prompt, list(range(at + step * fresh, at + (step + 1) * fresh)))
        rows = np.arange(b + 1)
        rows[b] = b + chunk - 1
        new = [rng.integers(1000, 100000, chunk).tolist()]
        dec = art.widths.decodable  # past it: -inf in both
        got = runner.prefill(mixed + [prompt], [[7 + step]] * b + new, rows).rows()[:b, :dec]
        want = runner.decode(twins, [7 + step] * b).rows()[:, :dec]
        runner.remove_sequence(prompt)
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        same = float((got.argmax(1) == want.argmax(1)).mean())
        steps.append({"max_rel_diff": rel, "argmax_agree": same})
    return {"chunk": chunk, "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunks", default="16,64,128,256,512,1024")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.model_runner import ModelRunner

    chunks = [int(c) for c in args.chunks.split(",")]
    art = Artifact(args.artifact, device=args.device)
    b = args.batch
    # each timed call adds a token to every decode row; the prompt slot starts afresh each call
    per_seq = args.context + (2 * len(chunks) + 1) * (args.repeats + 1) + 64
    prompt_pages = -(-max(chunks) // art.page_size)
    pages = -(-per_seq // art.page_size)
    total = (b * pages + prompt_pages) * art.page_size
    runner = ModelRunner(art, max_batch_size=b, max_total_tokens=total, num_slots=b + 1)
    rng = np.random.default_rng(0)
    slots = list(range(b))
    for s in slots:
        runner.add_sequence(s, list(range(s * pages, (s + 1) * pages)))
    fresh = list(range(b * pages, b * pages + prompt_pages))

    def new_prompt() -> None:
        runner.remove_sequence(b)
        runner.add_sequence(b, fresh)

    runner.add_sequence(b, fresh)
    for s in slots:
        runner.prefill([s], [rng.integers(1000, 100000, args.context).tolist()], np.array([0]))
    ones = [[1]] * b

    def decode() -> None:
        runner.decode(slots, [1] * b)

    check = check_mixed_rows(art, b, args.context, 64, np.random.default_rng(1))
    print("mixed rows against decode twins:", check["steps"], flush=True)
    rows = {"check": check, "decode_ms": median_ms(decode, args.repeats), "mixed": []}
    for n in chunks:
        chunk = [rng.integers(1000, 100000, n).tolist()]
        last = np.arange(b + 1, dtype=np.int32)
        last[b] = b + n - 1

        def one_forward(chunk=chunk, last=last) -> None:
            new_prompt()
            step = runner.prefill(slots + [b], ones + chunk, last)
            assert step.best is not None  # the picks came back: the step is done

        def split(chunk=chunk, n=n) -> None:
            new_prompt()
            decode()
            assert runner.prefill([b], chunk, np.array([n - 1])).best is not None

        one, two = median_ms(one_forward, args.repeats), median_ms(split, args.repeats)
        rows["mixed"].append({"chunk": n, "one_forward_ms": one, "split_ms": two})
        print(f"chunk {n:5d}: one forward {one:6.2f} ms ({one / rows['decode_ms']:.2f}x decode), "
              f"split {two:6.2f} ms ({two / rows['decode_ms']:.2f}x)", flush=True)  # fmt: skip
    print(f"decode step of {b}: {rows['decode_ms']:.2f} ms")
    report = {"device": args.device, "batch": b, "context": args.context, **rows}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mixed_step.json").write_text(json.dumps(report, indent=1))
    # bf16 noise between the prefill's and decode's kernels is ~1e-2 of the largest logit; a
    # row's state updated twice or never is of the order of the logits themselves
    bad = [s for s in check["steps"] if s["max_rel_diff"] > 0.1 or s["argmax_agree"] < 0.75]
    if bad:
        raise SystemExit(f"mixed steps' decode rows disagree with decode: {check['steps']}")


if __name__ == "__main__":
    main()
