"""Benchmark of the decode GEMV (schedules/gemv.py) alone, at every 4B and 9B projection shape:
decode's batches of 1-7 ("small") against dlight's GEMV rules (what decode ran before), and
decode_wide's of 8-64 ("wide") against the tiled tensor-core GEMM it ran before; both against
torch.matmul (cuBLAS).

Two steps, because the GPU server has no compiler:
  here (nvcc, no GPU):  python benchmarks/gemv_kernel.py build DIR [--arch sm_90] [--rows wide]
                        [--proj gate_up_proj] [--only ours,*_rms,...] [--balance] [--models 4b]
  on the GPU server:    python benchmarks/gemv_kernel.py run DIR [--out docs/results]

`build` takes each projection the way the model has it (bf16 x [batch, K] times W [N, K]ᵀ, cast
to bf16; out_proj, o_proj and down_proj with the residual add behind them), fuses it with the
CUDA pipeline's passes and compiles the decode PrimFunc, per shape and row class (`--rows`
small, wide or both), as
  ours         DecodeGemv, the rule the pipeline applies (default_config / wide_buckets)
  small:  m?w?u?s?   the kernel at other configs (m_tiles, warps_k, unroll, stages)
          dlight     dlight's GEMV / LowBatchGEMV(4), the rules decode used before
          *_rms      the kernel with the RMSNorm before it folded in (no residual only; a
                     norm without weight, which conversion puts in W's columns)
          gate_up:   ours_swiglu, ours_rms_swiglu and swiglu, decode's SwiGLU folded into
                     the GEMV, and the SwiGLU kernel alone (benchmarks/gemv_swiglu.py)
  wide:   gemv, mma  the GEMV's own plan and the swapped tensor-core GEMM's where it applies
                     (schedules/gemv_wide_mma.py; ours is one of them, by
                     gemv_config.WIDE_MMA); mma4-6: that GEMM's ring 4-6 stages deep,
                     mmae: its first weight tiles loaded before the wait for X's producer
                     (gate_up: *_rms_swiglu, as decode_wide runs it)
          regs       the 16-64 row buckets with the weight ring in registers
          m?         ... with that many m-tiles a warp
          half       ... with half the shared weight ring
          mma_wide   MatmulMMA(WIDE_DECODE_CONFIG), the tiled GEMM decode_wide used before
          wgmma      prefill's GEMM (wgmma + TMA on sm_90a, split-K for few tiles) on these
                     rows: a candidate for the 32-64 row buckets, where the GEMV streams at
                     42-60% of copy bandwidth and cuBLAS at 77-91% (not yet measured)
`run` measures, in one child process per shape and class, at batch 1, 4, 7 (small) or 16, 32,
64 (wide; batch 8, 9, 33 and 70 checked for correctness only):
  - correctness against a fp32 torch reference (max |out - ref| / max |ref|, cuBLAS's beside);
  - the kernel's CUPTI time (torch.profiler) per call, over a CUDA graph of calls that cycle
    through copies of W filling 4x the L2, so every call streams W from HBM, as in a decode
    step; also the graph's wall time per call (launch gaps included);
  - bytes moved (W, x, the residual read, out written) and their share of the copy bandwidth
    measured in the same process (common.copy_bandwidth: bytes read + written per second by a
    device-to-device copy; the roofline is bytes / the full copy bandwidth);
  - torch.matmul(x, w.T) in bf16 (cuBLAS, GEMM only, no residual) the same way.
A markdown table goes to stdout, the JSON to OUT/gemv_kernel.json (small only) or
gemv_kernel_wide.json (and DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

from gemv_variants import RMS_EPS, shape_kernels

MANIFEST = "gemv_bench.json"
BATCHES = {"small": (1, 4, 7), "wide": (16, 32, 64)}
# correctness only: bucket edges, odd rows, a second block of 64
CHECK_BATCHES = {"small": (), "wide": (8, 9, 33, 70)}
MIN_CALLS = 24  # calls per timed graph


def _picked(name: str, only: list[str]) -> bool:
    """`name` matches an entry of `only`: exactly, or "*_rms" any name ending so."""
    return any(name == o or (o[:1] == "*" and name.endswith(o[1:])) for o in only)


def build(
    out: Path,
    arch: str,
    rows: str = "small",
    only: list[str] | None = None,
    proj: str = "",
    balance: bool = False,
    models: tuple[str, ...] = ("4b", "9b"),
) -> None:
    import tvm
    from gemm_variants import fused_pair, param_roles, projections
    from gemv_swiglu import is_gate_up
    from gemv_variants import balance_probes

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.gemm_match import match_gemm

    target, arches = make_target("cuda", arch)
    prepare_cuda_codegen(arches)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    classes = ("small", "wide") if rows == "both" else (rows,)
    shapes = [("probe", shape) for shape in balance_probes()] if balance else [
        (model, shape) for model in models for shape in projections((model,))
    ]  # fmt: skip
    for model, shape in shapes:
        if proj and not any(
            name.endswith(f".{p}") for name in shape["names"] for p in proj.split(",")
        ):
            continue
        n, k, residual = shape["n"], shape["k"], shape["residual"]
        _, small = fused_pair(n, k, residual, target)
        small = small.with_attr("dlight.do_not_tensorize", True)
        for cls in classes:
            kernels, configs, errors = shape_kernels(small, cls, target, is_gate_up(shape["names"]))
            if only:
                kernels = {nm: f for nm, f in kernels.items() if _picked(nm, only)}
                configs = {nm: c for nm, c in configs.items() if _picked(nm, only)}
            if not kernels:
                continue
            tag = "" if cls == "small" else "wide_"
            file = f"gemv_{tag}{model}_{n}x{k}{'_res' if residual else ''}.so"
            mod = tvm.IRModule({nm: f.with_attr("global_symbol", nm) for nm, f in kernels.items()})
            tvm.compile(mod, target=target).export_library(str(out / file))
            entries.append(
                {
                    "model": model,
                    **shape,
                    "rows": cls,
                    "file": file,
                    "roles": param_roles(small),
                    "out_dtype": match_gemm(small).out_dtype,
                    "kernels": configs,
                    "batches": BATCHES[cls],
                    "check_batches": CHECK_BATCHES[cls],
                    "build_errors": errors,
                }
            )
            print(f"built {file}: {sorted(kernels)} {errors or ''}", flush=True)
    manifest = {"arch": arches, "rows": rows, "entries": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


# ---- GPU side ------------------------------------------------------------------------------


def _runner(torch, tvm_ffi, calls: list) -> tuple:
    """(run, how, wall seconds per call): `calls` captured into a CUDA graph, or replayed
    eagerly if the capture fails."""
    from common import cuda_time

    for c in calls:
        c()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
            for c in calls:
                c()
        run, how = graph.replay, "graph"
    except Exception as err:  # noqa: BLE001
        print(f"  graph capture failed ({err}); timing eager calls", file=sys.stderr)

        def run():
            for c in calls:
                c()

        how = "eager"
    return run, how, cuda_time(torch, run, iters=5) / len(calls)


def _kernel_us(torch, runs: dict, calls: int) -> dict[str, float]:
    """CUPTI time per call of each run's kernels, all in one profiler session; a kernel named
    NAME_kernel* is TVM function NAME's, any other (cuBLAS) torch's."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for run in runs.values():
            run()
            torch.cuda.synchronize()
    total = dict.fromkeys(runs, 0.0)
    for e in prof.key_averages():
        if e.device_time_total <= 0 or "Memcpy" in e.key or "Memset" in e.key:
            continue
        owner = next((r for r in runs if r != "torch" and e.key.startswith(f"{r}_kernel")), None)
        owner = owner or "torch"
        if owner in total:
            total[owner] += e.device_time_total
    return {name: t / calls for name, t in total.items()}


def _measure(out: Path, file: str) -> list[dict]:
    """In a child process: every kernel of one shape, and cuBLAS, at each batch."""
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm
    import tvm_ffi
    from common import copy_bandwidth, weight_copies
    from gemv_report import PREVIOUS
    from gemv_swiglu import ALONE, bytes_moved, is_rms, out_cols, reference

    from qwen35_tvm.runtime.artifact import device_of

    manifest = json.loads((out / MANIFEST).read_text())
    entry = next(e for e in manifest["entries"] if e["file"] == file)
    n, k, roles = entry["n"], entry["k"], entry["roles"]
    device_of("cuda")  # loads TVM's CUDA runtime
    bw = copy_bandwidth(torch)
    torch.cuda.empty_cache()
    lib = tvm.runtime.load_module(str(out / file))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(torch, n, k, gen)
    copies = len(ws)
    reps = -(-MIN_CALLS // copies)  # each graph: every copy `reps` times
    out_dtype = getattr(torch, entry["out_dtype"])
    dl = tvm.runtime.from_dlpack
    rows = []
    for batch in [*entry["batches"], *entry["check_batches"]]:
        timed = batch in entry["batches"]
        x = torch.randn(batch, k, device="cuda", generator=gen).bfloat16()
        res = torch.randn(batch, n, device="cuda", generator=gen).bfloat16()
        ref = x.float() @ ws[0].float().T
        if "res" in roles:
            ref += res.float()
        # "ours_rms" reads x as the input of an RMSNorm without weight
        inv = torch.rsqrt(x.float().square().mean(1, keepdim=True) + RMS_EPS)
        ref_rms = (x.float() @ ws[0].float().T) * inv
        gate_up = ref.bfloat16()  # the SwiGLU kernel's input (gemv_swiglu.py)
        scale = ref.abs().max().item()
        base = {
            "model": entry["model"],
            "names": entry["names"],
            "n": n,
            "k": k,
            "residual": entry["residual"],
            "rows": entry["rows"],
            "batch": batch,
            "copy_bw_tbs": bw / 1e12,
        }
        cublas = (x @ ws[0].T + res if "res" in roles else x @ ws[0].T).float()
        runs, batch_rows = {}, []
        # a check-only batch runs our kernels once each, untimed
        kernels = [kn for kn in entry["kernels"] if timed or kn not in PREVIOUS]
        for kernel in ["torch", *kernels] if timed else kernels:
            row = {**base, "kernel": kernel, "config": entry["kernels"].get(kernel)}
            rms = is_rms(kernel)
            row["bytes"] = bytes_moved(kernel, batch, n, k, out_dtype.itemsize, "res" in roles)
            try:
                if kernel == "torch":
                    got = cublas
                    calls = [lambda w=w, x=x: torch.matmul(x, w.T) for w in ws * reps]
                else:
                    fn = lib[kernel]
                    res_out = torch.empty(batch, out_cols(kernel, n), device="cuda",
                                          dtype=out_dtype)  # fmt: skip
                    named = {"x": dl(x), "res": dl(res), "out": dl(res_out),
                             "gate_up": dl(gate_up)}  # fmt: skip
                    order = sorted(roles, key=roles.get)
                    order = ["gate_up", "out"] if kernel == ALONE else order
                    argss = [[dl(w) if r == "w" else named[r] for r in order] for w in ws]
                    fn(*argss[0])
                    torch.cuda.synchronize()
                    got = res_out.float()
                    calls = [lambda a=a, fn=fn: fn(*a) for a in argss * reps]
                want = reference(torch, kernel, ref_rms if rms else ref)
                row["max_rel_err"] = (got - want).abs().max().item() / want.abs().max().item()
                row["cublas_rel_err"] = (cublas - ref).abs().max().item() / scale
                if not timed:
                    row["timed"] = "check only"
                    continue
                runs[kernel], row["timed"], wall = _runner(torch, tvm_ffi, calls)
                row["wall_us"] = wall * 1e6
            except Exception as err:  # noqa: BLE001  report, go on with the next kernel
                row["error"] = f"{type(err).__name__}: {err}"
                traceback.print_exc(file=sys.stderr)
            finally:
                batch_rows.append(row)
        if not timed:
            rows += batch_rows
            continue
        try:
            kernel_us = _kernel_us(torch, runs, copies * reps)
        except Exception as err:  # noqa: BLE001
            kernel_us = {}
            print(f"  profiler failed: {err}", file=sys.stderr)
        for row in batch_rows:
            if kernel_us.get(row["kernel"], 0) > 0:
                row["us"], row["us_from"] = kernel_us[row["kernel"]], "cupti"
            elif "wall_us" in row:  # no CUPTI: the graph's (or loop's) time per call
                row["us"], row["us_from"] = row["wall_us"], "wall"
            if "us" in row:
                row["pct_copy_bw"] = 100 * row["bytes"] / (row["us"] * 1e-6) / bw
        rows += batch_rows
    return rows


def run(out: Path, results: Path | None, timeout: int) -> None:
    from gemv_report import device_name, summarize, table_line

    manifest = json.loads((out / MANIFEST).read_text())
    rows: list[dict] = []
    print(
        "| model | projection | N x K | B | kernel | µs (CUPTI) | graph µs/call | MB moved |"
        " of copy bw | max rel err | cuBLAS µs | vs cuBLAS | vs before |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for entry in manifest["entries"]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "measure", str(out), entry["file"]]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            got = [json.loads(line) for line in proc.stdout.splitlines() if line[:1] == "{"]
            if proc.returncode != 0 or not got:
                got.append(
                    {
                        "file": entry["file"],
                        "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}",
                    }
                )
        except subprocess.TimeoutExpired:
            got = [{"file": entry["file"], "error": f"timeout {timeout}s"}]
        for r in got:
            print(table_line(r, got), flush=True)
        rows += got
    summary = summarize(rows)
    for line in summary["lines"]:
        print(line, file=sys.stderr)
    result = {
        "device": device_name(),
        "arch": manifest["arch"],
        "rows": rows,
        "best": summary["best"],
    }
    # decode's results keep their file; decode_wide's (or both) get their own
    small = manifest.get("rows", "small") == "small"
    name = "gemv_kernel.json" if small else "gemv_kernel_wide.json"
    (out / name).write_text(json.dumps(result, indent=1))
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        (results / name).write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run", "measure"])
    p.add_argument("dir", type=Path)
    p.add_argument("file", nargs="?", help="measure only: library file")
    p.add_argument("--arch", default="sm_90")
    p.add_argument(
        "--rows",
        choices=["small", "wide", "both"],
        default="small",
        help="build: decode's GEMMs (1-7 rows), decode_wide's (8-64) or both",
    )
    p.add_argument(
        "--only", default=None, help="build: these kernels only (names, *suffix; commas)"
    )
    p.add_argument("--proj", default="", help="build: these projections only (names, commas)")
    p.add_argument("--models", default="4b,9b", help="build: these models' shapes (commas)")
    p.add_argument(
        "--balance", action="store_true", help="build: the block-balance probe shapes instead"
    )
    p.add_argument("--out", type=Path, default=None, help="run: also write the JSON here")
    p.add_argument("--timeout", type=int, default=300, help="seconds per shape (run)")
    args = p.parse_args()
    if args.step == "build":
        only = args.only.split(",") if args.only else None
        build(args.dir, args.arch, args.rows, only, args.proj, args.balance,
              tuple(args.models.split(",")))  # fmt: skip
    elif args.step == "run":
        run(args.dir, args.out, args.timeout)
    else:
        for row in _measure(args.dir, args.file):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
