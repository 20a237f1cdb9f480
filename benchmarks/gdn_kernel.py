"""Benchmark of the gated delta rule kernels alone: recurrent (decode) vs chunked (prefill).

Two steps, because the GPU server has no compiler:
  here (nvcc, no GPU):  python benchmarks/gdn_kernel.py build DIR [--arch sm_90]
  on the GPU server:    python benchmarks/gdn_kernel.py run DIR [--out docs/results]

At the 4B shapes (16 key heads, 32 value heads, head dims 128), `run` times every kernel on one
sequence of 1,024 and of 8,192 tokens and on 16 sequences of 1,024 tokens (prefill), each
sequence starting from a non-zero state in a scattered slot; `--decode` adds 16 and 1 sequences
of 1 token. Kernels: the recurrent one, the fp32 chunked one (fp32 models), and the tensor-core
two-pass form (gdn_chunk_prep + gdn_chunk_scan, bf16 operands, fp32 state) at chunk 64 with 32
value columns a scan block, at chunk 32 with 64 (8 warps) or 32 (4 warps), and the default
(two_c32_few), whose scan takes the 32-column blocks for steps of few sequences and the
64-column ones otherwise; 2x1024 and 4x1024 are in between. Beside the default: its scan
writing o in fp32 as before session 50 (`_o32`), and its prep's forms gdn_chunked keeps off
(`_interior`, `_key`). Two-pass rows give prep and scan apart (`kernels_us`). The inputs are
in_proj-like rows (bf16), a conv history in each slot and conv weights and gates: gdn_input
(timed as its own row) makes q, k, v, g and beta from them for the recurrent and fp32 kernels
and the reference, while the two-pass form's first kernel starts from the rows themselves, as
in the model. The one-kernel tensor-core version they replaced (mma2_*) is in git before
session 12 and in gdn_kernel_two_pass.json's rows. `ragged` (7 short sequences) has partial
chunks and chunk numbers that no sequence takes. Every kernel is checked against a float64
torch recurrence (max |Δ| of outputs and final states, also relative to the largest |value|;
`ok` holds the kernel to its bound: 1e-4 fp32, 1e-2 bf16 operands (3e-3 in the CPU emulation)),
and each chunked variant against the recurrent kernel too. Decode rows also give the state
bytes over the copy bandwidth of the same run. Every variant and case is isolated: a failure is
printed and the rest still runs. A table goes to stdout and all rows, as JSON, to
DIR/gdn_bench_result.json (and --out DIR/gdn_kernel.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from common import copy_bandwidth, cuda_time

K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 16, 32, 128, 128, 4
HEADS = (K_HEADS, V_HEADS, K_DIM, V_DIM)
CONV_DIM = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
WIDTH = CONV_DIM + V_HEADS * V_DIM + 2 * V_HEADS  # in_proj's row: q k v | z | b | a
# ragged: partial chunks, chunk numbers no one has
CASES = {"1x1024": [1024], "2x1024": [1024] * 2, "1x8192": [8192], "4x1024": [1024] * 4,
         "16x1024": [1024] * 16, "ragged": [1, 31, 33, 100, 5, 64, 2]}  # fmt: skip
DECODE_CASES = {"16x1": [1] * 16, "1x1": [1], "64x1": [1] * 64}
# recurrent kernel variants: name -> (value columns a block, threads a column)
# (gdn_recurrent_sweep.json: 32 x 4, 16 x 4, 8 x 8 and 8 x 16 lost to the shipped 16 x 8)
RECURRENT = {"recurrent": (16, 8), "recurrent_r32p4": (32, 4)}
N_SLOTS, N_LAYERS, LAYER = 80, 2, 1  # slots for every sequence of the largest case
DEVICE = "cuda"  # a CPU smoke test of `run` swaps this (and the shapes) out
# name -> chunked_gated_delta_rule keywords (the fp32 kernel)
CHUNKED = {"fp32_c32": {"chunk": 32}}
# the two-pass form (gdn_chunked.two_pass): name -> its keywords
TWO_PASS = {
    "two_c64_t32": {"chunk": 64, "col_tile": 32, "few": None},
    "two_c32_t64": {"chunk": 32, "col_tile": 64, "few": None},
    # twice the scan blocks a sequence, each half the columns and warps
    "two_c32_t32w4": {"chunk": 32, "col_tile": 32, "scan_warps": 4, "few": None},
    "two_c32_few": {},  # the default: the scan picks one of the two above by the batch's size
    "two_c32_few_o32": {},  # the default with o in fp32 (before session 50), its scan rebuilt
    # the prep's forms (gdn_chunked.PREP_BY_KEY_HEAD, PREP_INTERIOR_LOADS; off by default)
    "two_c32_few_interior": {"interior_loads": True},
    "two_c32_few_key": {"by_key_head": True, "interior_loads": True},
}
REL_BOUND = {"fp32": 1e-4, "two": 1e-2, "recurrent": 1e-5}


def build(out: Path, arch: str, chunked: bool = True, only: set[str] | None = None) -> None:
    import tvm

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.gdn import gated_delta_rule
    from qwen35_tvm.schedules.gdn_chunk_scan import chunk_scan
    from qwen35_tvm.schedules.gdn_chunked import (
        FEW_SEQUENCES_SCAN,
        chunked_gated_delta_rule,
        core_out_dtype,
        two_pass,
    )
    from qwen35_tvm.schedules.gdn_chunked import TWO_PASS as SHIPPED
    from qwen35_tvm.schedules.gdn_prep import gdn_input

    target, arches = make_target("cuda", arch)
    prepare_cuda_codegen(arches)
    out.mkdir(parents=True, exist_ok=True)
    funcs = {
        name: gated_delta_rule(K_HEADS, V_HEADS, K_DIM, V_DIM, target, rows, parts)
        for name, (rows, parts) in RECURRENT.items()
    }
    funcs["input"] = gdn_input(K_HEADS, V_HEADS, K_DIM, V_DIM, CONV, "bfloat16", target)
    for name, kw in CHUNKED.items() if chunked else ():
        try:
            funcs[name] = chunked_gated_delta_rule(K_HEADS, V_HEADS, K_DIM, V_DIM, target, **kw)
        except Exception:  # keep the other variants
            traceback.print_exc()
    workspaces = {}  # name -> "tokens x sequences" -> the workspace's (shape, dtype)s
    o_dtypes = {}  # name -> the dtype of o the scan writes
    for name, kw in TWO_PASS.items() if chunked else ():
        try:
            two = two_pass(K_HEADS, V_HEADS, K_DIM, V_DIM, target, "bfloat16", kernel=CONV, **kw)
            scan, o_dtypes[name] = two.scan, core_out_dtype(*HEADS, target, "bfloat16")
            if name.endswith("_o32"):
                o_dtypes[name] = "float32"
                scan = chunk_scan(*HEADS, *SHIPPED, few=FEW_SEQUENCES_SCAN, o_dtype="float32")
            funcs[name] = {
                "prep": two.prep.with_attr("global_symbol", "prep"),
                "scan": scan.with_attr("global_symbol", "scan"),
            }
            workspaces[name] = {
                f"{sum(lengths)}x{len(lengths)}": two.workspace(sum(lengths), len(lengths))
                for lengths in {**CASES, **DECODE_CASES}.values()
            }
        except Exception:
            traceback.print_exc()
    built = []
    funcs = {n: f for n, f in funcs.items() if only is None or n in only | {"input"}}
    for name, func in funcs.items():
        try:
            mod = func if isinstance(func, dict) else {"main": func}
            lib = tvm.compile(tvm.IRModule(mod), target=target)
            lib.export_library(str(out / f"gdn_{name}.so"))
            built.append(name)
            print(f"built {name}")
        except Exception:  # keep the other variants
            traceback.print_exc()
    meta = {"arch": arches, "kernels": built, "two_pass": workspaces, "o_dtype": o_dtypes}
    (out / "gdn_bench.json").write_text(json.dumps(meta))


def two_pass_call(torch, tvm, lib, workspaces: dict):
    """The two kernels behind the one-kernel signature, on the workspace `TwoPass.workspace`
    gave at build time for each case; allocated once a case, outside the timed calls."""
    prep, scan = lib["prep"], lib["scan"]
    cache = {}

    def call(args, rows):
        q, k, v, g, beta, indptr, slots, pool, layer, out = args
        key = f"{q.shape[0]}x{slots.shape[0]}"
        if key not in cache:
            cache[key] = [
                tvm.runtime.from_dlpack(torch.zeros(s, dtype=getattr(torch, d), device=DEVICE))
                for s, d in workspaces[key]
            ]
        prep(*rows[:4], indptr, slots, rows[4], layer, *cache[key])
        scan(*cache[key], indptr, slots, pool, layer, out)

    return call


def make_inputs(torch, tvm, make_qkv, lengths: list[int], seed: int = 0) -> dict:
    """Model-like inputs on the GPU: in_proj rows, conv weights, gates and a conv history in
    every slot (bf16), and q, k, v, g, beta made from them by gdn_input (`make_qkv`): unit q
    and k, beta in (0, 1), log decays mostly in (-4, 0)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)

    slots = torch.randperm(N_SLOTS, device=DEVICE, generator=gen)[: len(lengths)]
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lengths), 0)
    bf16 = torch.bfloat16
    x = {
        "proj": randn(n, WIDTH).to(bf16),
        "conv_weight": (randn(CONV_DIM, CONV) * 0.5).to(bf16),
        "a_log": torch.log(torch.rand(V_HEADS, device=DEVICE, generator=gen) + 0.2),
        "dt_bias": randn(V_HEADS) * 0.5,
        "conv_pool": randn(N_SLOTS, N_LAYERS, CONV_DIM, CONV - 1).to(bf16),
        "indptr": indptr.to(DEVICE),
        "slots": slots.to(torch.int32),
        "pool": randn(N_SLOTS, N_LAYERS, V_HEADS, V_DIM, K_DIM) * 0.5,
    }
    x["q"] = torch.empty(n, K_HEADS, K_DIM, device=DEVICE)
    x["k"] = torch.empty(n, K_HEADS, K_DIM, device=DEVICE)
    x["v"] = torch.empty(n, V_HEADS, V_DIM, device=DEVICE)
    x["g"] = torch.empty(n, V_HEADS, device=DEVICE)
    x["beta"] = torch.empty(n, V_HEADS, device=DEVICE)
    make_qkv(*input_args(tvm, x))
    return x


def input_args(tvm, x: dict) -> list:
    """gdn_input's arguments: the rows, weights, gates, indptr, slots, conv history, layer and
    its five outputs."""
    names = ("proj", "conv_weight", "a_log", "dt_bias", "indptr", "slots", "conv_pool")
    args = [tvm.runtime.from_dlpack(x[name]) for name in names]
    outs = [tvm.runtime.from_dlpack(x[name]) for name in ("q", "k", "v", "g", "beta")]
    return [*args, LAYER, *outs]


def torch_reference(torch, x: dict) -> tuple:
    """The delta rule token by token in float64 with torch: (outputs, pool after)."""
    pool = x["pool"].double().clone()
    n = x["v"].shape[0]
    out = torch.zeros(n, V_HEADS, V_DIM, dtype=torch.float64, device=DEVICE)
    rep = V_HEADS // K_HEADS
    indptr = x["indptr"].tolist()
    for b, slot in enumerate(x["slots"].tolist()):
        for t in range(indptr[b], indptr[b + 1]):
            k = x["k"][t].double().repeat_interleave(rep, 0)  # [v heads, k dim]
            q = x["q"][t].double().repeat_interleave(rep, 0)
            s = pool[slot, LAYER] * torch.exp(x["g"][t].double())[:, None, None]
            delta = (x["v"][t].double() - (s @ k[:, :, None])[..., 0]) * x["beta"][t, :, None]
            s = s + delta[:, :, None] * k[:, None, :]
            pool[slot, LAYER] = s
            out[t] = (s @ q[:, :, None])[..., 0] * K_DIM**-0.5
    return out, pool


def kernel_args(tvm, x: dict, pool, out) -> tuple[list, list]:
    """The delta rule's arguments, and the rows, weights, gates and conv history that the
    two-pass form starts from, converted once so that timing sees only the launch."""
    names = ("q", "k", "v", "g", "beta", "indptr", "slots")
    args = [tvm.runtime.from_dlpack(x[name]) for name in names]
    rows = [tvm.runtime.from_dlpack(x[name])
            for name in ("proj", "conv_weight", "a_log", "dt_bias", "conv_pool")]  # fmt: skip
    return [*args, tvm.runtime.from_dlpack(pool), LAYER, tvm.runtime.from_dlpack(out)], rows


def kernel_times_us(torch, fn, iters: int = 10) -> dict[str, float]:
    """CUPTI time of one call's kernels, by kernel name (no launch gaps: inside a CUDA graph
    there are none)."""
    if DEVICE != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and "Memcpy" not in e.key]
    return {e.key: e.device_time_total / iters for e in events}


def kernel_time_us(torch, fn, iters: int = 10) -> float:
    """The sum of `kernel_times_us`."""
    return sum(kernel_times_us(torch, fn, iters).values()) if DEVICE == "cuda" else float("nan")


def run(
    out_dir: Path,
    results: Path | None = None,
    decode: bool = False,
    prefill: bool = True,
    cases: set[str] | None = None,
) -> None:
    import os

    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm

    from qwen35_tvm.runtime.artifact import device_of

    device_of(DEVICE)  # loads TVM's CUDA runtime
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    meta = json.loads((out_dir / "gdn_bench.json").read_text())
    print(f"device: {device}, kernels: {meta['kernels']}")
    fns = {}
    make_qkv = tvm.runtime.load_module(str(out_dir / "gdn_input.so"))["main"]
    for name in meta["kernels"]:
        if name == "input":
            continue
        try:
            lib = tvm.runtime.load_module(str(out_dir / f"gdn_{name}.so"))
            work = meta.get("two_pass", {}).get(name)
            fns[name] = (
                (lambda args, rows, f=lib["main"]: f(*args))
                if work is None
                else two_pass_call(torch, tvm, lib, work)
            )
        except Exception:
            traceback.print_exc()
    rows = []
    bw = copy_bandwidth(torch) if DEVICE == "cuda" else None
    print(f"copy bandwidth: {bw and bw / 1e12} TB/s")
    print("| case | kernel | time (µs) | kernel only (µs) | % of copy bw | vs recurrent |"
          " max abs Δ out vs torch | max abs Δ state vs torch | rel out | rel state | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case, lengths in {**(CASES if prefill else {}), **(DECODE_CASES if decode else {})}.items():
        if cases is not None and case not in cases:
            continue
        try:
            x = make_inputs(torch, tvm, make_qkv, lengths)
        except Exception:
            traceback.print_exc()
            continue
        n = sum(lengths)
        if max(lengths) > 1:  # what the two-pass form's first kernel took over
            a = input_args(tvm, x)
            us = kernel_time_us(torch, lambda a=a: make_qkv(*a))
            rows.append({"case": case, "kernel": "gdn_input", "tokens": n, "kernel_us": us})
            print(f"| {case} | gdn_input | - | {us:.1f} | | | | | | | |")
        ref = None
        exact = torch_reference(torch, x)
        for name, fn in fns.items():
            row = {"case": case, "kernel": name, "tokens": n}
            try:
                pool = x["pool"].clone()
                # the two passes keep o in bf16 on CUDA (gdn_chunked.core_out_dtype)
                o_dtype = meta.get("o_dtype", {}).get(name, "float32")
                out = torch.full((n, V_HEADS, V_DIM), float("nan"), device=DEVICE,
                                 dtype=getattr(torch, o_dtype))  # fmt: skip
                fn(*kernel_args(tvm, x, pool, out))  # (delta rule's args, the rows')
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                if name == "recurrent":
                    ref = (out, pool)
                elif ref is not None:
                    row["max_abs_diff_out"] = (out - ref[0]).abs().max().item()
                    row["max_abs_diff_state"] = (pool - ref[1]).abs().max().item()
                    row["max_abs_out"] = ref[0].abs().max().item()
                out = out.float()
                row["finite"] = bool(torch.isfinite(out).all().item())
                row["max_abs_diff_out_vs_torch"] = (out - exact[0]).abs().max().item()
                row["max_abs_diff_state_vs_torch"] = (pool - exact[1]).abs().max().item()
                row["rel_out"] = row["max_abs_diff_out_vs_torch"] / exact[0].abs().max().item()
                touched = exact[1][x["slots"].long(), LAYER]  # the states this call updates
                row["rel_state"] = row["max_abs_diff_state_vs_torch"] / touched.abs().max().item()
                bound = REL_BOUND[name.split("_")[0]]
                row["ok"] = row["finite"] and max(row["rel_out"], row["rel_state"]) < bound
                # timing updates scratch state and outputs again and again; values don't matter
                scratch = kernel_args(tvm, x, x["pool"].clone(), torch.empty(
                    out.shape, dtype=getattr(torch, o_dtype), device=DEVICE
                ))  # fmt: skip
                seconds = cuda_time(torch, lambda f=fn, a=scratch: f(*a))
                row["us"] = seconds * 1e6
                parts = kernel_times_us(torch, lambda f=fn, a=scratch: f(*a))
                row["kernel_us"] = sum(parts.values()) if parts else float("nan")
                if len(parts) > 1:  # the two-pass form: prep and scan apart
                    row["kernels_us"] = parts
                if bw and max(lengths) == 1:  # decode: the state is read and written once
                    state_bytes = len(lengths) * V_HEADS * V_DIM * K_DIM * 4 * 2
                    row["copy_bw_fraction"] = state_bytes / (row["kernel_us"] * 1e-6) / bw
            except Exception as err:
                traceback.print_exc()
                row["error"] = repr(err)[:500]
            rows.append(row)
            rec_us = next((r.get("us") for r in rows if r["case"] == case and
                           r["kernel"] == "recurrent"), None)  # fmt: skip
            speed = f"{rec_us / row['us']:.2f}x" if rec_us and row.get("us") else "-"
            print(
                f"| {case} | {name} | {row.get('us', float('nan')):.1f} | "
                f"{row.get('kernel_us', float('nan')):.1f} | "
                f"{100 * row.get('copy_bw_fraction', float('nan')):.1f}% | {speed} | "
                f"{row.get('max_abs_diff_out_vs_torch', '-')} | "
                f"{row.get('max_abs_diff_state_vs_torch', '-')} | "
                f"{row.get('rel_out', float('nan')):.2e} | {row.get('rel_state', float('nan')):.2e}"
                f" | {row.get('ok', False)} |"
                + (f" ERROR {row['error']}" if "error" in row else ""),
                flush=True,
            )
            for kname, kus in row.get("kernels_us", {}).items():
                print(f"|   | {kname} | | {kus:.1f} | | | | | | | |")
    result = {"device": device, "copy_bw_tbs": bw and bw / 1e12, "rows": rows}
    (out_dir / "gdn_bench_result.json").write_text(json.dumps(result, indent=1))
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        (results / "gdn_kernel.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run"])
    p.add_argument("dir", type=Path)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--decode", action="store_true", help="also time 16x1, 1x1, 64x1 (decode)")
    p.add_argument(
        "--decode-only", action="store_true", help="build: recurrent kernels; run: decode cases"
    )
    p.add_argument("--only", default=None, help="build: these kernels only (comma-separated)")
    p.add_argument("--cases", default=None, help="run: these cases only (comma-separated)")
    args = p.parse_args()
    if args.step == "build":
        only = set(args.only.split(",")) if args.only else None
        build(args.dir, args.arch, chunked=not args.decode_only, only=only)
    else:
        cases = set(args.cases.split(",")) if args.cases else None
        run(args.dir, args.out, args.decode or args.decode_only, not args.decode_only, cases)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
