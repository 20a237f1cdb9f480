"""Hardware counters of a decode step's kernels: Nsight Compute over one step per batch size.

  here:        python benchmarks/engine_throughput.py build DIR --variants graphs
  on the GPU:  python benchmarks/ncu_step.py prepare DIR WORK   (the artifact, random weights)
               ncu --profile-from-start off --clock-control none --launch-count N
                   --section ... --export REP
                   python benchmarks/ncu_step.py step WORK/art-4b-graphs --batch 16
               ncu --import REP.ncu-rep --page details --csv > DETAILS.csv
               ncu --import REP.ncu-rep --page raw --csv > RAW.csv
  anywhere:    python benchmarks/ncu_step.py summary DETAILS.csv RAW.csv [--out FILE.json]
  GEMVs alone: ncu ... python benchmarks/ncu_step.py gemv DIR [--kernel ours] [--batch 16]
               (DIR from benchmarks/gemv_kernel.py build: each shape's kernel called once)

CUPTI through torch.profiler (profile_step.py) says how long each kernel takes in the step;
this says why: DRAM throughput, achieved occupancy, and where warps stall. Each batch size
gets that many sequences of `context` random tokens, prefilled, a few decode steps to warm
up, then one step inside cudaProfilerStart/Stop, which is all ncu profiles with
`--profile-from-start off`. ncu serialises kernels and flushes the caches before each by
default, so it shows each kernel alone, cold, without its dependent-launch overlap.

`summary` averages each kernel's calls: duration, DRAM throughput (% of the DRAM's peak, not
of the copy bandwidth), the share of the elapsed cycles its SMs were active (below 1: SMs sat
idle while others finished: a ragged last wave, or blocks that take unequal time), achieved
warps an SM, cycles a warp waits per instruction issued, and the largest stall reasons.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def step(artifact_dir: Path, batches: list[int], context: int) -> None:
    import torch
    from common import prefill_random

    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.model_runner import ModelRunner

    artifact = Artifact(artifact_dir, device="cuda")
    per_seq = context + 64
    n = max(batches)
    runner = ModelRunner(artifact, max_batch_size=n, max_total_tokens=n * per_seq, num_slots=n)
    pages = -(-per_seq // artifact.page_size)
    rng = np.random.default_rng(0)
    cudart = torch.cuda.cudart()
    for b in batches:
        slots = list(range(b))
        prefill_random(runner, slots, pages, context, rng)
        for _ in range(3):
            runner.decode(slots, [1] * b)
        torch.cuda.synchronize()
        cudart.cudaProfilerStart()
        runner.decode(slots, [1] * b)
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        print(f"batch {b}: profiled one step", flush=True)
        for s in slots:
            runner.remove_sequence(s)


def gemv(out: Path, kernel: str, batch: int) -> None:
    """Call `kernel` of every shape of a gemv_kernel.py build once, on fresh random weights, and
    print its error against torch: for ncu, each shape's kernel alone (e.g. the --balance
    probes: whether a grid of one row tile an SM keeps its SMs busier than 160 tiles)."""
    import json
    import os

    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm
    from gemv_kernel import MANIFEST

    from qwen35_tvm.runtime.artifact import device_of

    device_of("cuda")  # loads TVM's CUDA runtime
    dl = tvm.runtime.from_dlpack
    for entry in json.loads((out / MANIFEST).read_text())["entries"]:
        n, k, roles = entry["n"], entry["k"], entry["roles"]
        lib = tvm.runtime.load_module(str(out / entry["file"]))
        w = (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16()
        x = torch.randn(batch, k, device="cuda").bfloat16()
        res = torch.randn(batch, n, device="cuda").bfloat16()
        got = torch.empty(batch, n, device="cuda", dtype=getattr(torch, entry["out_dtype"]))
        named = {"x": dl(x), "res": dl(res), "out": dl(got), "w": dl(w)}
        lib[kernel](*[named[r] for r in sorted(roles, key=roles.get)])
        want = x.float() @ w.float().T + (res.float() if "res" in roles else 0)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        print(f"{entry['file']}: {kernel} at {batch} rows, max rel err {err:.1e}", flush=True)


DETAILS = {
    "us": "Duration",
    "dram_pct": "DRAM Throughput",
    "elapsed": "Elapsed Cycles",
    "sm_active": "SM Active Cycles",
    "warps_per_sm": "Achieved Active Warps Per SM",
    "cycles_per_issue": "Warp Cycles Per Issued Instruction",
    "registers": "Registers Per Thread",
    "grid": "Grid Size",
    "block": "Block Size",
}
STALL = "smsp__average_warps_issue_stalled_"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def summary(details: Path, raw: Path) -> list[dict]:
    """One row a kernel name: its calls' means (DETAILS, stall reasons) from ncu's CSV pages."""
    import csv
    from collections import defaultdict

    calls: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    with details.open() as f:
        for r in list(csv.reader(f))[1:]:
            if len(r) > 14 and r[12] in DETAILS.values():
                calls[(int(r[0]), r[4])][r[12]] = _number(r[14])
    with raw.open() as f:
        head, _units, *rows = list(csv.reader(f))
    name = head.index("Kernel Name")
    # column -> the stall's reason, e.g. "long_scoreboard"
    stalls = {
        i: c[len(STALL) :].split("_per_")[0] for i, c in enumerate(head) if c.startswith(STALL)
    }
    for i, r in enumerate(rows):
        for col, reason in stalls.items():
            calls[(i, r[name])][reason] = _number(r[col])
    by_name: dict[str, list[dict[str, float]]] = defaultdict(list)
    for (_, kernel), m in sorted(calls.items()):
        by_name[kernel].append(m)
    out = []
    for kernel, ms in by_name.items():
        mean = {k: float(np.nanmean([m.get(k, np.nan) for m in ms])) for k in ms[0]}
        row = {"kernel": kernel, "calls": len(ms)}
        row.update({key: round(mean[src], 3) for key, src in DETAILS.items() if src in mean})
        row["sm_active_share"] = round(mean["SM Active Cycles"] / mean["Elapsed Cycles"], 3)
        reasons = {k: v for k, v in mean.items() if k not in DETAILS.values()}
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:4]
        row["stalls"] = {k: round(v, 2) for k, v in top}
        out.append(row)
    return out


def print_summary(rows: list[dict]) -> None:
    print("| kernel | calls | µs | DRAM % of peak | SM active share | warps an SM |"
          " cycles an issue | registers | grid | top stalls (cycles an issue) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        stalls = ", ".join(f"{k} {v}" for k, v in r["stalls"].items())
        print(f"| {r['kernel'][:48]} | {r['calls']} | {r.get('us', 0):.2f} | "
              f"{r.get('dram_pct', 0):.1f} | {r['sm_active_share']:.2f} | "
              f"{r.get('warps_per_sm', 0):.1f} | {r.get('cycles_per_issue', 0):.1f} | "
              f"{r.get('registers', 0):.0f} | {r.get('grid', 0):.0f} | {stalls} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pre = sub.add_parser("prepare")
    pre.add_argument("libs", type=Path)
    pre.add_argument("work", type=Path)
    pre.add_argument("--variant", default="graphs")
    st = sub.add_parser("step")
    st.add_argument("artifact", type=Path)
    st.add_argument("--batch", default="1,16")
    st.add_argument("--context", type=int, default=1024)
    ge = sub.add_parser("gemv")
    ge.add_argument("dir", type=Path)
    ge.add_argument("--kernel", default="ours")
    ge.add_argument("--batch", type=int, default=16)
    su = sub.add_parser("summary")
    su.add_argument("details", type=Path)
    su.add_argument("raw", type=Path)
    su.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.cmd == "prepare":
        from engine_throughput import _artifacts

        print(_artifacts(args.libs, args.work, "4b", [args.variant]))
    elif args.cmd == "gemv":
        gemv(args.dir, args.kernel, args.batch)
    elif args.cmd == "summary":
        import json

        rows = summary(args.details, args.raw)
        print_summary(rows)
        if args.out is not None:
            args.out.write_text(json.dumps(rows, indent=1))
    else:
        step(args.artifact, [int(b) for b in args.batch.split(",")], args.context)


if __name__ == "__main__":
    main()
