"""Where a decode step's and a prefill's GPU time goes: the CUPTI kernel table.

  on the GPU:  python benchmarks/profile_step.py ARTIFACT_DIR [--batch 1,16] [--context 1024]
               [--out docs/results]

ARTIFACT_DIR is an artifact with weights (engine_throughput.py leaves one per variant in its
WORK dir). Each batch size gets that many sequences of `context` random tokens, prefilled,
then `steps` decode steps run under torch.profiler, which records every TVM kernel through
CUPTI, inside CUDA graphs too. Kernels are grouped by name: calls per step, the µs each adds
to the step's span (its end past the latest end before it) and that share of the span, and
their CUPTI µs. The step's roofline (weights once, each sequence's GDN state read and written and
its K/V read, over the copy bandwidth of the same run) heads each table. The prefill of one
`context`-token prompt gets the same table, and with --mixed N so does a mixed step: the largest
batch's decode rows and a new prompt's first N tokens in one forward, as the engine runs it
beside running decodes. JSON: stdout and, with --out, profile_step.json.

The step's GPU time is `span_us`, from its first kernel's start to its last one's end. Under
programmatic dependent launch (schedules/pdl.py) a kernel starts while its producer runs and
CUPTI counts its wait as its own time, so the per-kernel µs overlap and `gpu_us`, their sum,
overstates the step; an artifact built with `dependent_launch=False` gives the table without
overlap. `wall_us` is a decode call with its host work (input copy, launch, reading the pick).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np


def idle_gaps(spans: list[tuple[float, float, str]], top: int = 12) -> dict:
    """Where the GPU sat idle inside one call (spans sorted by start, µs): the total, and the
    `top` longest gaps with the kernels on either side. Host launch and synchronisation show
    here; under dependent launch, kernels overlap and leave none."""
    gaps, end, last = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    gaps.sort(reverse=True)
    return {
        "idle_us": round(sum(g for g, _, _ in gaps), 1),
        "gaps": [{"us": round(g, 1), "after": a[:60], "before": b[:60]} for g, a, b in gaps[:top]],
    }


def added_time(calls_spans: list[list[tuple[float, float, str]]], repeats: int) -> dict:
    """µs each kernel adds to its call's span, a call on average: how far its end passes the
    latest end before it (spans sorted by start). Under dependent launch a kernel's CUPTI time
    includes its wait for the one before; this counts only what it adds, and the kernels' sums
    plus the idle gaps make the span."""
    added: dict[str, float] = defaultdict(float)
    for spans in calls_spans:
        end = spans[0][0]
        for _, stop, name in spans:
            added[name] += max(0.0, stop - end) / repeats
            end = max(end, stop)
    return added


def kernel_links(calls_spans: list[list[tuple[float, float, str]]], top: int = 16) -> list[dict]:
    """Each kernel after the one before it in start order (its producer in the stream), by
    pair, over all calls: how often a call runs the pair, and when the kernel starts and ends
    after its producer's end (µs, means; a start below zero is a launch beside the producer).
    A decode step is a chain of these handovers; the pairs are sorted by the µs they add."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for spans in calls_spans:
        for (_, prev_end, prev), (start, end, name) in zip(spans, spans[1:], strict=False):
            pair = acc[(prev[:60], name[:60])]
            pair[0] += 1
            pair[1] += start - prev_end
            pair[2] += end - prev_end
    rows = [
        {"after": prev, "kernel": name, "count": n / len(calls_spans),
         "start_us": round(s / n, 2), "end_us": round(e / n, 2)}
        for (prev, name), (n, s, e) in acc.items()
    ]  # fmt: skip
    rows.sort(key=lambda r: -r["end_us"] * r["count"])
    return rows[:top]


CALL = "profiled call"  # the record_function range around each call of the profiled function


def host_during(events, start: float, end: float, top: int = 40) -> list[dict]:
    """What the host did while the GPU sat idle from `start` to `end` (µs): the CPU-side
    events (CUDA runtime and driver calls, the record_function ranges of main()) that overlap
    the window, in time order, each with its offset from `start` and its duration."""
    rows = []
    for e in events:
        if e.device_type.name != "CPU":
            continue
        a, b = e.time_range.start, e.time_range.end
        if b >= start and a <= end:
            rows.append({"at_us": round(a - start, 1), "us": round(b - a, 1), "name": e.name[:60]})
    rows.sort(key=lambda r: r["at_us"])
    return rows[:top]


def kernel_table(
    torch, fn, repeats: int, host: bool = False
) -> tuple[list[dict], float, float, dict]:
    """(rows grouped by kernel name, summed kernel µs per call of `fn`, µs per call from the
    first kernel's start to the last one's end, the idle gaps of the last call) over `repeats`
    calls. With `host`, the gaps also say what the host did during the longest one."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            with record_function(CALL):
                fn()
        torch.cuda.synchronize()
    us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    spans = []
    for e in prof.events():
        # record_function ranges also show on the GPU's timeline, as annotations
        if e.device_type.name != "CUDA" or e.is_user_annotation or "Mem" in e.name[:8]:
            continue
        us[e.name] += e.device_time / repeats
        calls[e.name] += 1
        spans.append((e.time_range.start, e.time_range.end, e.name))
    total = sum(us.values())
    # every call runs the same kernels: the k-th chunk of them in start order is call k's
    spans.sort()
    per = len(spans) // repeats
    calls_spans = [spans[i * per : (i + 1) * per] for i in range(repeats)]
    span = sum(max(e for _, e, _ in c) - c[0][0] for c in calls_spans) / repeats
    added = added_time(calls_spans, repeats)
    rows = [
        {
            "kernel": name[:100],
            "calls": calls[name] / repeats,
            "us": round(t, 2),
            "added_us": round(added[name], 2),
            "share": round(added[name] / span, 4),
        }
        for name, t in sorted(us.items(), key=lambda kv: -added[kv[0]])
    ]
    idle = idle_gaps(calls_spans[-1])
    idle["links"] = kernel_links(calls_spans)
    if host:
        # the host's time before a call's first kernel starts and after its last one ends
        # (a synchronous call: the GPU idles through both)
        calls_on_host = sorted(
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.name == CALL and e.device_type.name == "CPU"
        )
        pairs = list(zip(calls_on_host, calls_spans, strict=True))
        lead = [c[0][0] - h[0] for h, c in pairs]
        tail = [h[1] - max(e for _, e, _ in c) for h, c in pairs]
        idle["host_before_first_kernel_us"] = round(sum(lead) / repeats, 1)
        idle["host_after_last_kernel_us"] = round(sum(tail) / repeats, 1)
    if host and idle["gaps"]:
        last = calls_spans[-1]
        i = max(range(1, len(last)), key=lambda k: last[k][0] - max(e for _, e, _ in last[:k]))
        window = (max(e for _, e, _ in last[:i]), last[i][0])
        idle["host_in_longest_gap"] = host_during(prof.events(), *window)
    return rows, total, span, idle


def print_table(title: str, rows: list[dict], total_us: float, span_us: float, top: int) -> None:
    kernels = sum(r["calls"] for r in rows)
    print(f"\n### {title}: {span_us:.0f} µs from first kernel to last ({total_us:.0f} µs summed)"
          f", {kernels:.0f} kernels\n")  # fmt: skip
    print("| kernel | calls | µs added to the span | share of the span | CUPTI µs |")
    print("|---|---|---|---|---|")
    for r in rows[:top]:
        print(f"| {r['kernel']} | {r['calls']:g} | {r['added_us']:.1f} | {100 * r['share']:.1f}%"
              f" | {r['us']:.1f} |")  # fmt: skip


def mixed_step(runner, slots: list[int], slot: int, pages: int, chunk: list[int]):
    """One engine mixed step as a call: `slots` decode a token each inside the prefill forward
    of a new prompt's first `chunk` tokens in `slot` (reset each call, as a new prompt's is)."""

    def call() -> None:
        runner.add_sequence(slot, list(range(slot * pages, (slot + 1) * pages)))
        rows = np.arange(len(slots)).tolist() + [len(slots) + len(chunk) - 1]
        runner.prefill(slots + [slot], [[1]] * len(slots) + [chunk], np.array(rows)).rows()
        runner.remove_sequence(slot)

    call()  # loads the prefill kernels at this shape
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("--batch", default="1,16")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--mixed", type=int, default=0, help="also profile a mixed step of N tokens")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch
    from common import copy_bandwidth, cuda_time, prefill_random
    from engine_throughput import step_bytes

    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.model_runner import ModelRunner

    batches = [int(b) for b in args.batch.split(",")]
    artifact = Artifact(args.artifact, device="cuda")
    per_seq = args.context + args.steps * 3 + 16
    n = max(batches) + 1  # one more slot for the prefill profile
    runner = ModelRunner(artifact, max_batch_size=max(batches), max_total_tokens=n * per_seq,
                         num_slots=n)  # fmt: skip
    pages = -(-per_seq // artifact.page_size)
    bw = copy_bandwidth(torch)
    rng = np.random.default_rng(0)
    report: dict = {"device": torch.cuda.get_device_name(), "copy_bw_tbs": bw / 1e12}

    def prompt() -> list[int]:
        return rng.integers(1000, 100000, args.context).tolist()

    for b in batches:
        slots = list(range(b))
        prefill_random(runner, slots, pages, args.context, rng)
        runner.decode(slots, [1] * b)  # captures this batch size's graph
        step = lambda s=slots: runner.decode(s, [1] * len(s))  # noqa: E731
        rows, total, span, idle = kernel_table(torch, step, 3, host=True)
        wall = cuda_time(torch, step, iters=10) * 1e6
        roof_us = step_bytes(artifact, b, args.context) / bw * 1e6
        key = f"decode_b{b}"
        report[key] = {"gpu_us": total, "span_us": span, "wall_us": wall, "roofline_us": roof_us,
                       **idle, "kernels": rows}  # fmt: skip
        title = (f"decode, batch {b} at {args.context} tokens (roofline {roof_us:.0f} µs, "
                 f"{wall:.0f} µs a call with its host work)")  # fmt: skip
        print_table(title, rows, total, span, args.top)
        print(f"host before the first kernel: {idle['host_before_first_kernel_us']} µs, after the"
              f" last: {idle['host_after_last_kernel_us']} µs a call")  # fmt: skip
        print("\n| after | kernel | a call | starts µs after its end | ends µs after |")
        print("|---|---|---|---|---|")
        for r in idle["links"][:10]:
            print(f"| {r['after']} | {r['kernel']} | {r['count']:g} | {r['start_us']:.2f} |"
                  f" {r['end_us']:.2f} |")  # fmt: skip
        if args.mixed and b == max(batches):
            mixed = mixed_step(runner, slots, n - 1, pages, prompt()[: args.mixed])
            key = f"mixed_b{b}_{args.mixed}"
            rows, total, span, idle = kernel_table(torch, mixed, 3, host=True)
            report[key] = {"gpu_us": total, "span_us": span, **idle, "kernels": rows}
            print_table(f"mixed step: {b} decode rows + {args.mixed} prompt tokens", rows, total,
                        span, args.top)  # fmt: skip
            print(f"idle inside: {idle['idle_us']:.0f} µs; host before the first kernel: "
                  f"{idle['host_before_first_kernel_us']} µs, after the last: "
                  f"{idle['host_after_last_kernel_us']} µs a call")  # fmt: skip
        for s in slots:
            runner.remove_sequence(s)
    slot = n - 1

    # named host ranges, so the gap's listing says which part of a prefill the host was in
    from torch.profiler import record_function

    def named(name: str, fn):
        def call(*a, **k):
            with record_function(name):
                return fn(*a, **k)

        return call

    runner._inputs.upload = named("inputs.upload", runner._inputs.upload)
    runner._prefill = named("vm.prefill", runner._prefill)
    tokens = prompt()

    def prefill() -> None:
        with record_function("add_sequence"):
            runner.add_sequence(slot, list(range(slot * pages, (slot + 1) * pages)))
        with record_function("runner.prefill"):
            step = runner.prefill([slot], [tokens], np.array([args.context - 1]))
        with record_function("rows"):
            step.rows()
        runner.remove_sequence(slot)

    prefill()  # loads the prefill kernels
    rows, total, span, idle = kernel_table(torch, prefill, 2, host=True)
    report[f"prefill_{args.context}"] = {"gpu_us": total, "span_us": span, **idle, "kernels": rows}
    print_table(f"prefill of {args.context} tokens", rows, total, span, args.top)
    print(f"\nidle inside the prefill: {idle['idle_us']:.0f} µs; longest gaps:")
    for g in idle["gaps"]:
        print(f"  {g['us']:7.1f} µs  after {g['after']}  before {g['before']}")
    print(f"host before the first kernel: {idle['host_before_first_kernel_us']} µs, after the"
          f" last: {idle['host_after_last_kernel_us']} µs a call")  # fmt: skip
    print("the host during the longest gap (µs from its start, µs long):")
    for h in idle.get("host_in_longest_gap", []):
        print(f"  {h['at_us']:8.1f} {h['us']:8.1f}  {h['name']}")
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_step.json").write_text(text)


if __name__ == "__main__":
    main()
