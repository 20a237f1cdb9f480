"""Engine-level throughput on a GPU at real shapes (bf16), with and without CUDA graphs
(`--variants graphs,no-graphs`) or programmatic dependent launch (`graphs,no-pdl`). A variant
`NAME:sync` runs library NAME with synchronous decode steps (no launch-ahead), `NAME:split` with
a mixed step's decode and prefill as two forwards (runtime/engine.py), `NAME:sync:split` both;
`NAME:sampled` samples with Qwen3.5's suggested settings (temperature 0.7, top_p 0.8, top_k 20)
instead of greedy decoding, drawn on the device, `NAME:sampled:host` by the host's sampler;
`NAME:sampled:top_p` with top_p 0.9 alone (temperature 1), as OpenAI clients send it.

  here:        python benchmarks/engine_throughput.py build DIR [--shape 4b]
  on the GPU:  python benchmarks/engine_throughput.py run DIR WORK [--shape 4b] [--constrained]

For each concurrency c: c requests of random 1,024-token prompts (`--prompt`), 256 greedy output
tokens each (EOS ignored), submitted together to one Engine, no HTTP. Reports TTFT (submit to first
token), TPOT (first to last token, per request; an early request's holds the chunks of the
later prompts' prefills), the decode step alone (the steps after the last first token), output
tokens/s over the whole batch, and the roofline step time of the same run: bytes a decode step
must move (weights once, plus each sequence's GDN state read and written and its KV read) over
the copy bandwidth.

With --constrained, each level runs twice on the same prompts: free, then with every request
constrained by a JSON schema (xgrammar; the bitmask applied on the device), rows marked by
`constrained`. The grammar needs the tokenizer: `build` keeps one gzipped copy (3.7 MB) in DIR
instead of a 20 MB tokenizer.json per library, and `run` restores it.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
from engine_constrained import check_constrain_kernels, compiled_grammar, time_constraints

PROMPT, OUTPUT = 1024, 256
CONCURRENCY = (1, 8, 16)
# name: (CUDA graphs, programmatic dependent launch)
VARIANTS = {"graphs": (True, True), "no-graphs": (False, True), "no-pdl": (True, False)}
TOKENIZER_GZ = "tokenizer.json.gz"


def build(out: Path, shape: str, variants: list[str]) -> None:
    from common import build_library

    for name in variants:
        lib = out / f"{shape}-{name}"
        graphs, pdl = VARIANTS[name]
        seconds = build_library(shape, "bfloat16", lib, cuda_graph=graphs, dependent_launch=pdl)
        print(f"{shape} bf16 {name} library compiled in {seconds:.1f} s")
        tokenizer = lib / "tokenizer.json"  # the same vocabulary for every shape
        if not (out / TOKENIZER_GZ).exists():
            (out / TOKENIZER_GZ).write_bytes(gzip.compress(tokenizer.read_bytes(), 9))
        tokenizer.unlink()


def _artifacts(libs: Path, work: Path, shape: str, variants: list[str]) -> dict[str, Path]:
    """Weights are written once and converted once for each parameter list (a library built
    before the norms were folded into the projections lists them); every variant links to its
    list's files."""
    import hashlib
    import shutil

    from qwen35_tvm.compile.convert import convert_weights
    from qwen35_tvm.compile.random_model import SHAPES, write_random_model

    dirs = {name: work / f"art-{shape}-{name}" for name in variants}
    for name, d in dirs.items():
        shutil.copytree(libs / f"{shape}-{name}", d, dirs_exist_ok=True)
        if not (d / "tokenizer.json").exists() and (libs / TOKENIZER_GZ).exists():
            (d / "tokenizer.json").write_bytes(gzip.decompress((libs / TOKENIZER_GZ).read_bytes()))
    hf_dir = work / f"hf-{shape}"
    if not (hf_dir / "config.json").exists():
        write_random_model(SHAPES[shape], hf_dir, dtype="bfloat16")
    for name in variants:
        params = json.loads((dirs[name] / "artifact.json").read_text())["params"]
        key = hashlib.sha256(json.dumps(params).encode()).hexdigest()[:8]
        # converted once a work dir: later runs (other variants too) link the same files
        weights = work / f"weights-{shape}-{key}"
        done = weights / "artifact.json"
        if not done.exists() or "weights" not in json.loads(done.read_text()):
            shutil.copytree(libs / f"{shape}-{name}", weights, dirs_exist_ok=True)
            convert_weights(hf_dir, weights)
        meta = json.loads(done.read_text())
        for f in meta["weights"]:
            target = dirs[name] / f
            if not target.exists():
                os.symlink((weights / f).resolve(), target)  # a relative work dir too
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


def run_level(
    engine, prompts: list[list[int]], grammar: tuple | None = None, sampled: tuple = ()
) -> dict:
    """One level; with `grammar` (a GrammarCompiler and a compiled grammar) every request is
    constrained, and the row says how long the engine waited for masks and applied them; with
    `sampled` (temperature, top_p, top_k), sampling instead of greedy decoding."""
    from qwen35_tvm.runtime.sampler import SamplingParams

    params = SamplingParams(*sampled) if sampled else SamplingParams(temperature=0.0)
    states = [grammar[0].state(grammar[1]) if grammar else None for _ in prompts]
    timers = time_constraints(engine, states) if grammar else None
    start = time.perf_counter()
    ids = [
        engine.submit(p, params, OUTPUT, ignore_eos=True, grammar=g)
        for p, g in zip(prompts, states, strict=True)
    ]
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
    # steps once every prompt has its first token: decode alone, no prefill chunk beside it
    # (a level's TPOT also holds the later prompts' prefills, which its early requests wait on)
    admitted = max(s[0] for s in stamps.values())
    gaps = (b - a for s in stamps.values() for a, b in itertools.pairwise(s) if a >= admitted)
    decode_gaps = list(gaps)
    assert all(len(s) == OUTPUT for s in stamps.values()), "a request stopped early"
    row = dict(
        concurrency=len(prompts),
        constrained=grammar is not None,
        sampled=list(sampled) or False,
        ttft_ms_mean=1e3 * float(np.mean(ttft)),
        ttft_ms_max=1e3 * float(np.max(ttft)),
        tpot_ms_mean=1e3 * float(np.mean(tpot)),
        decode_step_ms_mean=1e3 * float(np.mean(decode_gaps)) if decode_gaps else None,
        output_tok_s=len(prompts) * OUTPUT / wall,
        wall_s=wall,
        tokens=[tokens[i] for i in ids],
    )
    if timers is not None:
        steps = max(1, timers["steps"])
        row |= {
            "device_masks": engine.runner.constrains_on_device,
            # tokens the grammar accepted per request (the rest came after the JSON ended)
            "constrained_tokens_mean": float(np.mean([g.accepted for g in states])),
            "json_complete": sum(not g.active for g in states),
            "mask_wait_ms_per_step": 1e3 * timers["wait"] / steps,
            "constrain_ms_per_step": 1e3 * timers["constrain"] / steps,
        }
        timers["undo"]()
    return row


def first_token_times(engine, prompts: list[list[int]]) -> dict:
    """TTFT of each prompt alone on an idle engine (one output token), one after another: a
    level's c1 row holds a single sample, and one prefill varies by ~1 ms from run to run."""
    from qwen35_tvm.runtime.sampler import SamplingParams

    greedy, times = SamplingParams(temperature=0.0), []
    for p in prompts:
        start = time.perf_counter()
        engine.submit(p, greedy, 1, ignore_eos=True)
        while engine.has_work():
            engine.step()
        times.append(1e3 * (time.perf_counter() - start))
    return {
        "ttft_alone_ms_median": float(np.median(times)),
        "ttft_alone_ms_min": float(np.min(times)),
        "ttft_alone_ms": [round(t, 3) for t in times],
    }


def run(
    libs: Path,
    work: Path,
    shape: str,
    variants: list[str],
    levels: list[int],
    constrained: bool = False,
    prompt: int = PROMPT,
    prefill_chunk: int | None = None,
    ttft_repeats: int = 0,
) -> dict:
    import torch
    from common import copy_bandwidth

    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.engine import Engine

    t0 = time.time()
    # "NAME:sync" runs library NAME with every decode step synchronous (no launch-ahead)
    dirs = _artifacts(libs, work, shape, list(dict.fromkeys(v.split(":")[0] for v in variants)))
    print(f"weights ready in {time.time() - t0:.0f} s", flush=True)
    bw = copy_bandwidth(torch)
    results: dict = {
        "shape": shape,
        "device": torch.cuda.get_device_name(),
        "copy_bw_tbs": bw / 1e12,
        "prompt_tokens": prompt,
        "prefill_chunk": prefill_chunk,
    }
    max_c = max(levels)
    for name in variants:
        lib, *modes = name.split(":")
        artifact = Artifact(dirs[lib], device="cuda")
        rng = np.random.default_rng(0)  # the same prompts for every variant
        t0 = time.time()
        chunk = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        tokens = max_c * (prompt + OUTPUT + 64)
        engine = Engine(
            artifact,
            max_batch_size=max_c,
            max_total_tokens=tokens,
            overlap=False if "sync" in modes else None,
            one_forward="split" not in modes,
            **chunk,
        )
        print(f"{name}: engine ready in {time.time() - t0:.1f} s: {engine.capacity()}", flush=True)
        sampled = (1.0, 0.9) if "top_p" in modes else (0.7, 0.8, 20) if "sampled" in modes else ()
        if "host" in modes:
            engine.runner.draws_on_device = False  # sampled rows go to the host's sampler
        grammar = compiled_grammar(artifact) if constrained else None
        if constrained:
            results[f"{name}_kernel_check"] = check = check_constrain_kernels(engine.runner)
            print(name, "constrained kernels vs numpy:", json.dumps(check), flush=True)
        warm = [rng.integers(1000, 100000, 64).tolist()]
        run_level(engine, warm, sampled=sampled)  # loads every kernel
        if grammar:
            run_level(engine, warm, grammar)  # and the constrained ones, and xgrammar
        rows = []
        for c in levels:
            prompts = [rng.integers(1000, 100000, prompt).tolist() for _ in range(c)]
            for g in (None, grammar) if grammar else (None,):
                row = run_level(engine, prompts, g, sampled)
                # Mid-generation context: the prompt plus half the outputs.
                # The whole copy bandwidth: it counts bytes read and written, and a read stream
                # reaches ~95% of it (earlier runs divided by half of it).
                roof = step_bytes(artifact, c, prompt + OUTPUT // 2) / bw
                row["roofline_step_ms"] = roof * 1e3
                row["tpot_over_roofline"] = row["tpot_ms_mean"] / (roof * 1e3)
                if row["decode_step_ms_mean"] is not None:
                    row["decode_step_over_roofline"] = row["decode_step_ms_mean"] / (roof * 1e3)
                rows.append(row)
                shown = {k: v for k, v in row.items() if k != "tokens"}
                print(name, json.dumps(shown), flush=True)
            if grammar:
                free, held = rows[-2:]
                held["tpot_over_free"] = held["tpot_ms_mean"] / free["tpot_ms_mean"]
                print(f"{name} c{c}: constrained TPOT / free TPOT = {held['tpot_over_free']:.3f}")
        results[name] = rows
        if ttft_repeats:
            alone = [rng.integers(1000, 100000, prompt).tolist() for _ in range(ttft_repeats)]
            results[f"{name}_first_token"] = first = first_token_times(engine, alone)
            print(name, json.dumps({k: v for k, v in first.items() if k != "ttft_alone_ms"}))
        del engine, artifact
        torch.cuda.empty_cache()
    # the same kernels launched otherwise (graphs, dependent launch): greedy tokens must not
    # change; each variant against the first, a flag per level
    greedy = [v for v in variants if "sampled" not in v]
    results["greedy_tokens_identical"] = {
        name: [
            a["tokens"] == b["tokens"]
            for a, b in zip(results[greedy[0]], results[name], strict=True)
        ]
        for name in greedy[1:]
    }
    for rows in (results[n] for n in variants):
        for row in rows:  # a digest, so runs in other calls can be compared token for token
            row["tokens_sha1"] = hashlib.sha1(json.dumps(row.pop("tokens")).encode()).hexdigest()
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
    p.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens a request")
    p.add_argument(
        "--constrained", action="store_true", help="also run each level JSON-schema constrained"
    )
    p.add_argument("--prefill-chunk", type=int, default=None, help="the Engine's (its default)")
    p.add_argument(
        "--ttft-repeats", type=int, default=0, help="also time N prompts alone, one at a time"
    )
    args = p.parse_args()
    variants = args.variants.split(",")
    if args.step == "build":
        build(args.dir, args.shape, variants)
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        levels = [int(c) for c in args.levels.split(",")]
        out = run(args.dir, args.work, args.shape, variants, levels, args.constrained,
                  args.prompt, args.prefill_chunk, args.ttft_repeats)  # fmt: skip
        (args.work / "engine.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
