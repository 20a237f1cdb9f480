"""Where a lone prompt's first token spends host time: Engine.step's phases for one prompt at a
time on an idle GPU, timed with perf_counter, and the GPU's time from the VM's prefill call to
its last kernel (torch CUDA events on the stream TVM launches on).

Two steps, because the GPU server has no compiler:
  here (nvcc, no GPU):  python benchmarks/gpu_parity.py build DIR --shapes 0.8b --dtypes bfloat16
  on the GPU server:    python benchmarks/host_ttft.py DIR/0.8b-bfloat16 [--shape 0.8b]

Random weights of --shape are written and converted once into WORK. The medians over the
prompts after the first three go to stdout and, with --out, to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("library", type=Path, help="a built library folder (gpu_parity.py build)")
    p.add_argument("work", type=Path, nargs="?", default=Path("/tmp/qwen35-host-ttft"))
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=13)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    from qwen35_tvm.compile.convert import convert_weights
    from qwen35_tvm.compile.random_model import SHAPES, write_random_model
    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.engine import Engine
    from qwen35_tvm.runtime.sampler import SamplingParams

    art = args.work / "art"
    if not (args.work / "done").exists():
        hf = write_random_model(SHAPES[args.shape], args.work / "hf", dtype="bfloat16")
        shutil.copytree(args.library, art, dirs_exist_ok=True)
        convert_weights(hf, art)
        (args.work / "done").write_text("")
    engine = Engine(Artifact(art, device="cuda"), max_batch_size=1,
                    max_total_tokens=args.prompt + 64)  # fmt: skip
    runner, ms = engine.runner, defaultdict(list)

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                ms[name].append(1e3 * (time.perf_counter() - t0))

        return call

    vm_prefill, events = runner._prefill, []

    def prefill_with_events(*a, **k):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = timed("vm.prefill (host)", vm_prefill)(*a, **k)
        e1.record()
        events.append((e0, e1))
        return out

    runner._prefill = prefill_with_events
    runner.add_sequence = timed("add_sequence", runner.add_sequence)
    runner._upload = timed("_upload", runner._upload)
    runner.prefill = timed("runner.prefill", runner.prefill)
    runner._assign = timed("vm.assign_pages", runner._assign)
    runner._reset = timed("vm.reset_gdn_slots", runner._reset)
    rng, greedy = np.random.default_rng(0), SamplingParams(temperature=0.0)
    for _ in range(args.prompts):
        prompt = rng.integers(1000, 100000, args.prompt).tolist()
        t0 = time.perf_counter()
        engine.submit(prompt, greedy, 1, ignore_eos=True)
        t1 = time.perf_counter()
        while engine.has_work():
            engine.step()
        ms["ttft"].append(1e3 * (time.perf_counter() - t0))
        ms["submit"].append(1e3 * (t1 - t0))
    torch.cuda.synchronize()
    ms["gpu: VM call start to its last kernel"] = [a.elapsed_time(b) for a, b in events]
    out = {k: round(float(np.median(v[3:])), 4) for k, v in ms.items()}  # _upload: both calls
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "prompt": args.prompt, **out}))


if __name__ == "__main__":
    main()
