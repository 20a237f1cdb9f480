"""GPU check that decode's GEMV kernels are deterministic when chained the way a decode step
chains them (benchmarks/gemv_kernel.py's build DIR: with gemv_rule.DECODE_BULK on, the 4B
shapes take the bulk ring of schedules/gemv_bulk.py, whose copies race the lanes if its
protocol is wrong).

Every kernel of every shape in DIR is called over copies of its weight that fill the L2 4x
(so each call streams its weight from HBM, and a stage's stale bytes differ from its new ones),
the shapes interleaved, each call writing its own output; the chain is captured in one CUDA
graph and replayed many times. Each call's output is compared bit for bit with the same call
run alone before the graph. The sums' order is fixed, so any mismatch is a race.
gemv_kernel.py builds its kernels without the dependent-launch tag
(compile/pipeline.tag_dependent_launch), so the chain here runs them one after another:
session 37's race, which needs the tag and GDN's or the attention's kernel behind in_proj or
qkv, did not show here (docs/performance.md).

  here:  python benchmarks/gemv_kernel.py build DIR --models 4b --only ours,ours_rms,*_swiglu
  GPU:   python benchmarks/gemv_determinism.py DIR [--replays 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path


def _calls(torch, tvm, entry: dict, lib, batch: int, gen) -> list[tuple]:
    """(name, fn, args, out) of each kernel of one shape at `batch` rows, over weight copies."""
    from common import weight_copies
    from gemv_swiglu import ALONE, out_cols

    n, k, roles = entry["n"], entry["k"], entry["roles"]
    ws = weight_copies(torch, n, k, gen)
    x = torch.randn(batch, k, device="cuda", generator=gen).bfloat16()
    res = torch.randn(batch, n, device="cuda", generator=gen).bfloat16()
    gate_up = torch.randn(batch, n, device="cuda", generator=gen).bfloat16()
    dl, dtype = tvm.runtime.from_dlpack, getattr(torch, entry["out_dtype"])
    order = sorted(roles, key=roles.get)
    out = []
    for kernel in entry["kernels"]:
        if kernel == ALONE:  # no weight: nothing to race
            continue
        for w in ws:
            o = torch.empty(batch, out_cols(kernel, n), device="cuda", dtype=dtype)
            named = {"x": dl(x), "res": dl(res), "out": dl(o), "gate_up": dl(gate_up), "w": dl(w)}
            name = f"{entry['names'][0]}:{kernel}:b{batch}"
            out.append((name, lib[kernel], [named[r] for r in order], o))
    return out


def check(root: Path, replays: int, batches: tuple[int, ...]) -> dict:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm
    import tvm_ffi
    from gemv_kernel import MANIFEST

    from qwen35_tvm.runtime.artifact import device_of

    device_of("cuda")
    manifest = json.loads((root / MANIFEST).read_text())
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_shape = []
    for entry in manifest["entries"]:
        lib = tvm.runtime.load_module(str(root / entry["file"]))
        for batch in batches:
            per_shape.append(_calls(torch, tvm, entry, lib, batch, gen))
    # a step's order: one call of each shape in turn
    calls = [c for c in itertools.chain(*itertools.zip_longest(*per_shape)) if c]
    alone = []
    for _, fn, args, out in calls:
        fn(*args)
        torch.cuda.synchronize()
        alone.append(out.clone())
    graph = torch.cuda.CUDAGraph()
    with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
        for _, fn, args, _ in calls:
            fn(*args)
    rows: dict[str, dict] = {}
    for name, *_ in calls:
        rows.setdefault(name, {"calls": 0, "mismatched": 0, "max_rel_diff": 0.0})
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        for (name, _, _, out), want in zip(calls, alone, strict=True):
            row = rows[name]
            row["calls"] += 1
            if not torch.equal(out, want):
                row["mismatched"] += 1
                diff = (out.float() - want.float()).abs().max().item()
                rel = diff / max(want.float().abs().max().item(), 1e-30)
                row["max_rel_diff"] = max(row["max_rel_diff"], rel)
    return {
        "gpu": torch.cuda.get_device_name(),
        "arch": manifest["arch"],
        "replays": replays,
        "calls_a_replay": len(calls),
        "kernels": rows,
        "deterministic": all(r["mismatched"] == 0 for r in rows.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--batches", default="1", help="rows of each call (commas)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = check(args.dir, args.replays, tuple(int(b) for b in args.batches.split(",")))
    for name, row in result["kernels"].items():
        print(f"{name}: {row['mismatched']}/{row['calls']} calls differ "
              f"(max rel {row['max_rel_diff']:.3g})")  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "kernels"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
