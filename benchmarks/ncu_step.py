"""Hardware counters of a decode step's kernels: Nsight Compute over one step per batch size.

  here:        python benchmarks/engine_throughput.py build DIR --variants graphs
  on the GPU:  python benchmarks/ncu_step.py prepare DIR WORK   (the artifact, random weights)
               ncu --profile-from-start off --clock-control none --launch-count N \
                   --section ... python benchmarks/ncu_step.py step WORK/art-4b-graphs \
                   --batch 1,16

CUPTI through torch.profiler (profile_step.py) says how long each kernel takes in the step;
this says why: DRAM throughput, achieved occupancy, and where warps stall. Each batch size
gets that many sequences of `context` random tokens, prefilled, a few decode steps to warm
up, then one step inside cudaProfilerStart/Stop, which is all ncu profiles with
`--profile-from-start off`. ncu serialises kernels and flushes the caches before each by
default, so it shows each kernel alone, cold, without its dependent-launch overlap.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def step(artifact_dir: Path, batches: list[int], context: int) -> None:
    import torch

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
        for s in slots:
            runner.add_sequence(s, list(range(s * pages, (s + 1) * pages)))
            tokens = rng.integers(1000, 100000, context).tolist()
            runner.prefill([s], [tokens], np.array([context - 1]))
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
    args = p.parse_args()
    if args.cmd == "prepare":
        from engine_throughput import _artifacts

        print(_artifacts(args.libs, args.work, "4b", [args.variant]))
    else:
        step(args.artifact, [int(b) for b in args.batch.split(",")], args.context)


if __name__ == "__main__":
    main()
