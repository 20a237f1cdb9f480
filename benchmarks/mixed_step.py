"""What a mixed step costs against a pure decode step: the prefill-chunk sizes a step beside
running decodes can afford (runtime/step_costs.py sizes them by time).

  on the GPU:  python benchmarks/mixed_step.py ARTIFACT_DIR [--batch 16] [--out docs/results]

ARTIFACT_DIR is an artifact with weights (engine_throughput.py leaves one per variant in its
WORK dir). `batch` sequences of `context` random tokens are prefilled; then, with host time
included (each call ends by reading its picks, as the engine's steps do), the table times a
pure decode step of the batch and, for each chunk size n, a mixed step both ways: one forward
(the decode rows ride in the prefill call as one-token chunks: the engine's default) and split
(a decode call, then a prefill call of n tokens). The chunk is a new prompt's first each time
(its slot is reset, inside the timing, both ways), and one forward whose chunk does not end its
prompt (no logits row for it: `mid_prompt_ms`). Each time is the median of `repeats`. Then
a decode step and a mixed step after it, as the engine runs them when a prompt arrives during
decoding: read one after the other (`pair_sync_ms`), and with the mixed step launched while the
decode step runs, its decode rows fed that step's picks on the device (`pair_ahead_ms`); their
difference is the host time a mixed step no longer adds.

The GPU check first: twin sequences (the same prompts in other slots) step twice, one set as a
mixed step's decode rows beside a prompt chunk, the other by decode calls; their logits must
agree within bf16 noise (a mixed step's one-token rows take decode's GDN kernel, and the chunked
kernels skip them: a row updated twice or never shows at the second step). And a mixed step
launched ahead, fed on the device, must pick exactly the tokens the host-fed one picks.
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


def twin_runner(art, b: int, context: int, chunk: int, rng):
    """A runner whose slots b..2b-1 hold the same random `context`-token prompts as 0..b-1,
    and pages for two `chunk`-token prompts after them (slots 2b and 2b + 1, not added)."""
    from qwen35_tvm.runtime.model_runner import ModelRunner

    pages, fresh = -(-(context + 4) // art.page_size), -(-chunk // art.page_size)
    total = (2 * b * pages + 2 * fresh) * art.page_size
    runner = ModelRunner(art, max_batch_size=b, max_total_tokens=total, num_slots=2 * b + 2)
    for s in range(2 * b):
        runner.add_sequence(s, list(range(s * pages, (s + 1) * pages)))
    for s in range(b):
        tokens = rng.integers(1000, 100000, context).tolist()
        for t in (s, s + b):
            runner.prefill([t], [tokens], np.array([context - 1]))
    at = 2 * b * pages
    return runner, [list(range(at + k * fresh, at + (k + 1) * fresh)) for k in range(2)]


def check_mixed_rows(art, b: int, context: int, chunk: int, rng) -> dict:
    """Largest |logit difference| over the largest |logit|, and argmax agreement, between
    decode rows stepped inside mixed steps and their twins stepped by decode calls, per step."""
    runner, fresh = twin_runner(art, b, context, chunk, rng)
    mixed, twins, prompt = list(range(b)), list(range(b, 2 * b)), 2 * b
    steps = []
    for step in range(2):
        runner.add_sequence(prompt, fresh[step])
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


def check_fed_ahead(art, b: int, context: int, chunk: int, rng) -> dict:
    """A decode step then a mixed step on twin sequences: one twin set read step by step (the
    host feeds the picks), the other launched back to back (`launch_prefill` copies the
    in-flight picks on the device). The same kernels on the same inputs: equal picks."""
    runner, fresh = twin_runner(art, b, context, chunk, rng)
    sync, ahead = list(range(b)), list(range(b, 2 * b))
    for k in range(2):
        runner.add_sequence(2 * b + k, fresh[k])
    new = rng.integers(1000, 100000, chunk).tolist()
    rows = np.append(np.arange(b), b + chunk - 1)
    first = runner.decode(sync, [7] * b)
    fed = [[int(t)] for t in first.best]
    want = runner.prefill(sync + [2 * b], fed + [new], rows)
    launched = runner.launch_decode(ahead, [7] * b)
    mixed = runner.launch_prefill(ahead + [2 * b + 1], [[0]] * b + [new], rows, list(range(b)))
    ids, _ = launched.wait()
    got, logprobs = mixed.wait()
    return {
        "decode_same": bool((ids == first.best).all()),
        "mixed_same": bool((got == want.best).all()),
        "logprob_max_diff": float(np.abs(logprobs - want.best_logprob).max()),
    }


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
    # each timed call adds a token or two to every decode row; the prompt slot starts afresh
    per_seq = args.context + (7 * len(chunks) + 1) * (args.repeats + 1) + 64
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
    fed = check_fed_ahead(art, b, args.context, 64, np.random.default_rng(2))
    print("a mixed step fed on the device against one fed by the host:", fed, flush=True)
    rows = {"check": check, "fed_check": fed, "decode_ms": median_ms(decode, args.repeats)}
    rows["mixed"] = []
    for n in chunks:
        chunk = [rng.integers(1000, 100000, n).tolist()]
        last = np.arange(b + 1, dtype=np.int32)
        last[b] = b + n - 1

        def one_forward(chunk=chunk, last=last) -> None:
            new_prompt()
            step = runner.prefill(slots + [b], ones + chunk, last)
            assert step.best is not None  # the picks came back: the step is done

        def mid_prompt(chunk=chunk, last=last) -> None:  # no row for the prompt: b, not b + 1
            new_prompt()
            assert runner.prefill(slots + [b], ones + chunk, last[:b]).best is not None

        def split(chunk=chunk, n=n) -> None:
            new_prompt()
            decode()
            assert runner.prefill([b], chunk, np.array([n - 1])).best is not None

        def pair_sync(chunk=chunk, last=last) -> None:
            new_prompt()
            decode()
            assert runner.prefill(slots + [b], ones + chunk, last).best is not None

        def pair_ahead(chunk=chunk, last=last) -> None:
            new_prompt()
            first = runner.launch_decode(slots, [1] * b)
            mixed = runner.launch_prefill(slots + [b], ones + chunk, last, list(range(b)))
            first.wait()
            mixed.wait()

        one, two = median_ms(one_forward, args.repeats), median_ms(split, args.repeats)
        sync, ahead = median_ms(pair_sync, args.repeats), median_ms(pair_ahead, args.repeats)
        mid = median_ms(mid_prompt, args.repeats)
        rows["mixed"].append({"chunk": n, "one_forward_ms": one, "split_ms": two,
                              "mid_prompt_ms": mid, "pair_sync_ms": sync,
                              "pair_ahead_ms": ahead})  # fmt: skip
        print(f"chunk {n:5d}: one forward {one:6.2f} ms ({one / rows['decode_ms']:.2f}x decode), "
              f"split {two:6.2f} ms ({two / rows['decode_ms']:.2f}x); decode + mixed "
              f"{sync:6.2f} ms in turn, {ahead:6.2f} ms launched ahead; mid-prompt {mid:6.2f} "
              "ms", flush=True)  # fmt: skip
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
    if not (fed["decode_same"] and fed["mixed_same"]):
        raise SystemExit(f"a mixed step fed on the device picked other tokens: {fed}")


if __name__ == "__main__":
    main()
