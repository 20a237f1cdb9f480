"""Engine-level throughput on a GPU at real shapes (bf16), with and without CUDA graphs.

  here:        python benchmarks/engine_throughput.py build DIR [--shape 4b]
  on the GPU:  python benchmarks/engine_throughput.py run DIR WORK [--shape 4b]

For each concurrency c: c requests of random 1,024-token prompts, 256 greedy output tokens
each (EOS ignored), submitted together to one Engine, no HTTP. Reports TTFT (submit to first
token), TPOT (first to last token, per request), output tokens/s over the whole batch, and the
roofline step time of the same run: bytes a decode step must move (weights once, plus each
sequence's GDN state read and written and its KV read) over the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

PROMPT, OUTPUT = 1024, 256
CONCURRENCY = (1, 8, 16)
VARIANTS = {"graphs": True, "no-graphs": False}


def build(out: Path, shape: str) -> None:
    from common import build_library

    for name, graphs in VARIANTS.items():
        seconds = build_library(shape, "bfloat16", out / f"{shape}-{name}", cuda_graph=graphs)
        print(f"{shape} bf16 {name} library compiled in {seconds:.1f} s")


def _artifacts(libs: Path, work: Path, shape: str) -> dict[str, Path]:
    """Weights are written and converted once; every variant links to the same files."""
    import shutil

    from qwen35_tvm.compile.convert import convert_weights
    from qwen35_tvm.compile.random_model import SHAPES, write_random_model

    first, *rest = VARIANTS
    dirs = {name: work / f"art-{shape}-{name}" for name in VARIANTS}
    for name, d in dirs.items():
        shutil.copytree(libs / f"{shape}-{name}", d, dirs_exist_ok=True)
    hf_dir = work / f"hf-{shape}"
    if not (hf_dir / "config.json").exists():
        write_random_model(SHAPES[shape], hf_dir, dtype="bfloat16")
    convert_weights(hf_dir, dirs[first])
    meta = json.loads((dirs[first] / "artifact.json").read_text())
    for name in rest:
        for f in meta["weights"]:
            target = dirs[name] / f
            if not target.exists():
                os.symlink(dirs[first] / f, target)
        m = json.loads((dirs[name] / "artifact.json").read_text())
        m["weights"] = meta["weights"]
        (dirs[name] / "artifact.json").write_text(json.dumps(m, indent=2))
    return dirs


def step_bytes(artifact, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences at `context` tokens must move at least."""
    from first_timings import _weight_bytes_per_token

    from qwen35_tvm.runtime.kv_pool import gdn_bytes_per_slot, kv_bytes_per_token

    weights = _weight_bytes_per_token(artifact)
    state = 2 * gdn_bytes_per_slot(artifact)  # read and written back
    return weights + batch * (state + context * kv_bytes_per_token(artifact))


def run_level(engine, prompts: list[list[int]]) -> dict:
    from qwen35_tvm.runtime.sampler import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    start = time.perf_counter()
    ids = [engine.submit(p, greedy, OUTPUT, ignore_eos=True) for p in prompts]
    stamps: dict[int, list[float]] = {i: [] for i in ids}
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            stamps[out.request_id] += [now] * len(out.token_ids)
            tokens[out.request_id] += out.token_ids
    wall = time.perf_counter() - start
    ttft = [s[0] - start for s in stamps.values()]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values()]
    assert all(len(s) == OUTPUT for s in stamps.values()), "a request stopped early"
    return dict(
        concurrency=len(prompts),
        ttft_ms_mean=1e3 * float(np.mean(ttft)),
        ttft_ms_max=1e3 * float(np.max(ttft)),
        tpot_ms_mean=1e3 * float(np.mean(tpot)),
        output_tok_s=len(prompts) * OUTPUT / wall,
        wall_s=wall,
        tokens=[tokens[i] for i in ids],
    )


def run(libs: Path, work: Path, shape: str, variants: list[str], levels: list[int]) -> dict:
    import torch
    from common import copy_bandwidth

    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.engine import Engine

    t0 = time.time()
    dirs = _artifacts(libs, work, shape)
    print(f"weights ready in {time.time() - t0:.0f} s", flush=True)
    bw = copy_bandwidth(torch)
    results: dict = {
        "shape": shape,
        "device": torch.cuda.get_device_name(),
        "copy_bw_tbs": bw / 1e12,
    }
    max_c = max(levels)
    for name in variants:
        art_dir = dirs[name]
        artifact = Artifact(art_dir, device="cuda")
        rng = np.random.default_rng(0)  # the same prompts for every variant
        t0 = time.time()
        engine = Engine(
            artifact, max_batch_size=max_c, max_total_tokens=max_c * (PROMPT + OUTPUT + 64)
        )
        print(f"{name}: engine ready in {time.time() - t0:.1f} s: {engine.capacity()}", flush=True)
        run_level(engine, [rng.integers(1000, 100000, 64).tolist()])  # loads every kernel
        rows = []
        for c in levels:
            prompts = [rng.integers(1000, 100000, PROMPT).tolist() for _ in range(c)]
            row = run_level(engine, prompts)
            # Mid-generation context: the prompt plus half the outputs.
            # The whole copy bandwidth: it counts bytes read and written, and a read stream
            # reaches ~95% of it (earlier runs divided by half of it).
            roof = step_bytes(artifact, c, PROMPT + OUTPUT // 2) / bw
            row["roofline_step_ms"] = roof * 1e3
            row["tpot_over_roofline"] = row["tpot_ms_mean"] / (roof * 1e3)
            rows.append(row)
            print(name, json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        results[name] = rows
        del engine, artifact
        torch.cuda.empty_cache()
    if len(variants) == 2:  # graphs replay the same kernels: greedy tokens must not change
        pairs = zip(*(results[n] for n in variants), strict=True)
        results["greedy_tokens_identical"] = [a["tokens"] == b["tokens"] for a, b in pairs]
    for rows in (results[n] for n in variants):
        for row in rows:
            row.pop("tokens")
    print(json.dumps(results, indent=2))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run"])
    p.add_argument("dir", type=Path)
    p.add_argument("work", type=Path, nargs="?", default=Path("/tmp/qwen35-engine"))
    p.add_argument("--shape", default="4b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--levels", default=",".join(map(str, CONCURRENCY)))
    args = p.parse_args()
    if args.step == "build":
        build(args.dir, args.shape)
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        levels = [int(c) for c in args.levels.split(",")]
        out = run(args.dir, args.work, args.shape, args.variants.split(","), levels)
        (args.work / "engine.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
