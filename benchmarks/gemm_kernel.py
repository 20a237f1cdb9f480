"""Benchmark of the projection GEMMs alone: our bf16 tensor-core kernel (schedules/matmul.py)
against torch.matmul (cuBLAS), at the 4B model's (N, K) shapes.

Two steps, because the GPU server has no compiler:
  here (nvcc, no GPU):  python benchmarks/gemm_kernel.py build DIR [--arch sm_90]
  on the GPU server:    python benchmarks/gemm_kernel.py run DIR

`build` takes each projection of the models in --shapes (default 4b,9b) the way the model has
it (`Linear`: bf16 x [M, K] times W [N, K]ᵀ to fp32, cast to bf16; out_proj, o_proj and
down_proj with the residual add FuseOps puts behind them), fuses it with the CUDA pipeline's
passes and compiles, per shape, the PrimFunc as:
  prefill  mma        our kernel as the pipeline builds it (wgmma on sm_90a, else mma.sync)
           mma_only   the mma.sync-only default (every arch; what prefill ran before wgmma)
           wg_*       the pipeline's kernel with other wgmma tilings (WGMMA_VARIANTS)
           swiglu     the pipeline's kernel storing silu(first half) · second half [M, N / 2]
                      (a gate_up's SwiGLU; checked against silu(bf16(gate)) · bf16(up))
           mma_*      the same kernel with other configs (VARIANTS), to pick the default
  (the tables and these kernels' construction: benchmarks/gemm_variants.py)
  with --baselines:
  prefill  simt       dlight's gpu.Matmul on SIMT (what prefill ran before the kernel)
  decode   gemv       dlight's LowBatchGEMV
           simt       dlight's gpu.Matmul
`run` checks each against a fp32 torch reference (max |ours - ref| / max |ref|; the output
starts as NaN, so an element never written shows) and times it (best of 20, CUDA events; up to
M = 256 each call reads another copy of the weight, so none is served from L2) with
torch.matmul(x, w.T) in bf16 in the same process, M in {16, 64, 128, 256, 512, 1024, 4096} for
prefill (split-K below 1,024: schedules/split_k.py) and {1, 4, 16, 64} for decode. One child
process a shape runs cuBLAS and all its kernels; if it dies, the kernels it had not finished get
a child each. Prints a table and a summary (per variant and M: geometric mean speed against the
default and against cuBLAS; the fastest correct variant a shape) to stderr, and the JSON (also
DIR/gemm_bench_result.json) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

# `run --ms 1024,2048,4096` measures those M alone, cuBLAS too (children read the environment)
ONLY_M = tuple(int(m) for m in os.environ.get("GEMM_BENCH_MS", "").split(",") if m)
PREFILL_M = ONLY_M or (16, 64, 128, 256, 512, 1024, 4096)
DECODE_M = (1, 4, 16, 64)
MANIFEST = "gemm_bench.json"


def build(out: Path, arch: str, shapes: tuple[str, ...], baselines: bool, only: str | None) -> None:
    import tvm
    from gemm_variants import projections, variant_kernels

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target

    target, arches = make_target("cuda", arch)
    prepare_cuda_codegen(arches)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for proj in projections(shapes):
        n, k, residual = proj["n"], proj["k"], proj["residual"]
        kernels, errors, roles = variant_kernels(n, k, residual, target, baselines, only)
        file = f"gemm_{n}x{k}{'_res' if residual else ''}.so"
        mod = tvm.IRModule(
            {name: f.with_attr("global_symbol", name) for name, f in kernels.items()}
        )
        tvm.compile(mod, target=target).export_library(str(out / file))
        entries.append(
            {
                **proj,
                "file": file,
                "roles": roles,
                "kernels": sorted(kernels),
                "build_errors": errors,
            }
        )
        print(f"built {file}: {sorted(kernels)} {errors or ''}", flush=True)
    (out / MANIFEST).write_text(json.dumps({"arch": arches, "entries": entries}, indent=1))


# ---- GPU side ------------------------------------------------------------------------------

COLD_M = 256  # up to here weights are read cold (_measure)


def _rel_err(got, want) -> float:
    """max |got - want| / max |want|; NaN (an element never written) makes it NaN."""
    return (got.float() - want).abs().max().item() / want.abs().max().item()


def _cycled(arg_sets: list, fn):
    """A call of `fn` taking the next of `arg_sets` each time."""
    at = [0]

    def call():
        fn(*arg_sets[at[0] % len(arg_sets)])
        at[0] += 1

    return call


def _measure(out: Path, file: str, kernels: list[str]) -> None:
    """In a child process: kernels (or "torch") of one shape at every M, one JSON row printed
    as each is done. Inputs and the fp32 reference are made once per M."""
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm
    from common import cuda_time, weight_copies
    from gemm_variants import SWIGLU

    from qwen35_tvm.runtime.artifact import device_of

    manifest = json.loads((out / MANIFEST).read_text())
    entry = next(e for e in manifest["entries"] if e["file"] == file)
    n, k, roles = entry["n"], entry["k"], entry["roles"]
    device_of("cuda")  # loads TVM's CUDA runtime
    lib = None if kernels == ["torch"] else tvm.runtime.load_module(str(out / file))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()

    def ms_of(kernel: str) -> tuple[int, ...]:
        if kernel == "torch":
            return ONLY_M or (*PREFILL_M, *DECODE_M)
        return DECODE_M if kernel.startswith("decode") else PREFILL_M

    ms = sorted({m for kernel in kernels for m in ms_of(kernel)})
    # at M <= COLD_M the weight is what a GEMM streams, and one copy would stay in L2 between
    # calls (4B's n = 2,560 weights are 21-47 MB): timed calls cycle through copies, as a step's
    # GEMMs read theirs from HBM
    cold = [w, *weight_copies(torch, n, k, gen)[1:]] if ms[0] <= COLD_M else [w]
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        res = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
        ref = x.float() @ w.float().T
        if "res" in roles:
            ref += res.float()
        # the SwiGLU of the GEMM as gate_up reaches the SwiGLU kernel: bf16 halves
        gate, up = ref[:, : n // 2].bfloat16().float(), ref[:, n // 2 :].bfloat16().float()
        refs = {SWIGLU: torch.nn.functional.silu(gate) * up}
        # `run --reverse`: the other order, so a second pass evens out what runs early or late
        order = kernels[::-1] if os.environ.get("GEMM_BENCH_REVERSE") else kernels
        weights = cold if m <= COLD_M else [w]  # the copies timed calls cycle through
        for kernel in order:
            if m not in ms_of(kernel):
                continue
            row = {"file": file, "kernel": kernel, "m": m, "n": n, "k": k}
            want = refs[SWIGLU] if kernel.startswith(SWIGLU) else ref
            try:
                if kernel == "torch":
                    got = x @ w.T + res if "res" in roles else x @ w.T
                    err = _rel_err(got, want)
                    seconds = cuda_time(torch, _cycled([(x, c.T) for c in weights], torch.matmul))
                else:
                    fn = lib[kernel]
                    cols = want.shape[1]
                    got = torch.full((m, cols), float("nan"), device="cuda", dtype=torch.bfloat16)
                    named = {"x": x, "w": w, "res": res, "out": got}
                    order = sorted(roles, key=roles.get)
                    args = [tvm.runtime.from_dlpack(named[r]) for r in order]
                    fn(*args)
                    torch.cuda.synchronize()
                    # checked before the timed calls, which write other weights' products there
                    err = _rel_err(got, want)
                    cycle = [
                        [tvm.runtime.from_dlpack({**named, "w": c}[r]) for r in order]
                        for c in weights
                    ]
                    seconds = cuda_time(torch, _cycled(cycle, fn))
                row.update(
                    us=seconds * 1e6,
                    tflops=2 * m * n * k / seconds / 1e12,
                    weight_gbs=n * k * 2 / seconds / 1e9,
                    max_rel_err=err,
                )
            except Exception as err:  # noqa: BLE001  report, go on with the next kernel
                row["error"] = f"{type(err).__name__}: {err}"
                traceback.print_exc(file=sys.stderr)
            print(json.dumps(row), flush=True)
        del x, res, ref, refs


def _child(out: Path, file: str, kernels: list[str], timeout: int) -> tuple[list[dict], str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "measure", str(out), file, *kernels]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        got = [json.loads(line) for line in stdout.splitlines() if line[:1] == "{"]
        return got, f"timeout {timeout}s"
    got = [json.loads(line) for line in proc.stdout.splitlines() if line[:1] == "{"]
    return got, "" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-1500:]}"


def run(out: Path, timeout: int) -> None:
    """A child process a shape runs cuBLAS and all its kernels; if it dies (a faulting kernel
    poisons the CUDA context), the kernels it had not finished get a child each."""
    manifest = json.loads((out / MANIFEST).read_text())
    rows: list[dict] = []
    for entry in manifest["entries"]:
        file = entry["file"]
        got, error = _child(out, file, ["torch", *entry["kernels"]], timeout)
        if error:
            done = {r["kernel"] for r in got}
            # the kernel that was running when it died has some rows: measure it again too
            last = got[-1]["kernel"] if got else None
            got = [r for r in got if r["kernel"] != last]
            for kernel in ["torch", *entry["kernels"]]:
                if kernel in done and kernel != last:
                    continue
                again, error = _child(out, file, [kernel], timeout)
                if error:
                    again.append({"file": file, "kernel": kernel, "error": error})
                got += again
        rows += got
        for r in got:
            print(_line(r, rows), file=sys.stderr, flush=True)
    result = {"arch": manifest["arch"], "rows": _with_cublas_ratio(rows)}
    big = tuple(sorted({r["m"] for r in result["rows"] if r.get("m", 0) >= 1024}))
    result["summary"] = _summary(result["rows"], big or (1024, 4096))
    print(_summary_text(result["summary"]), file=sys.stderr, flush=True)
    (out / "gemm_bench_result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def _summary(rows: list[dict], ms: tuple[int, ...] = (1024, 4096)) -> dict:
    """Per prefill variant and M: geometric mean over shapes of its speed against the default
    ("prefill_mma") and against cuBLAS, and which shapes it wins; the best variant a shape.
    A variant with a wrong result (error > 2e-2) at any shape is marked, not ranked."""
    import math

    ok = {
        (r["file"], r["kernel"], r["m"]): r
        for r in rows
        if "us" in r and r["kernel"].startswith("prefill_mma")
    }
    bad = sorted(
        {k for (_, k, _), r in ok.items() if not r["max_rel_err"] < 2e-2}
        | {r["kernel"] for r in rows if "error" in r and r["kernel"].startswith("prefill_mma")}
    )
    files = sorted({f for f, _, _ in ok})
    kernels = sorted({k for _, k, _ in ok})
    out: dict = {"wrong_or_failed": bad, "by_m": {}}
    for m in ms:
        per: dict = {}
        for kern in kernels:
            vs_default, vs_cublas = [], []
            for f in files:
                r, base = ok.get((f, kern, m)), ok.get((f, "prefill_mma", m))
                if r and base:
                    vs_default.append(base["us"] / r["us"])
                    if "speed_vs_cublas" in r:
                        vs_cublas.append(r["speed_vs_cublas"])
            if vs_default:
                per[kern] = {
                    "vs_default": math.exp(sum(map(math.log, vs_default)) / len(vs_default)),
                    "vs_cublas": math.exp(sum(map(math.log, vs_cublas)) / len(vs_cublas))
                    if vs_cublas
                    else None,
                }
        best = {}
        for f in files:
            cands = [(ok[(f, kk, m)]["us"], kk) for kk in kernels if (f, kk, m) in ok]
            cands = [c for c in cands if c[1] not in bad]
            if cands:
                us, kk = min(cands)
                best[f] = {
                    "kernel": kk,
                    "us": us,
                    **{x: ok[(f, kk, m)].get(x) for x in ("tflops", "speed_vs_cublas")},
                }
        out["by_m"][str(m)] = {"variants": per, "best": best}
    return out


def _summary_text(summary: dict) -> str:
    lines = [f"wrong or failed: {summary['wrong_or_failed'] or 'none'}"]
    for m, part in summary["by_m"].items():
        lines.append(f"M={m}: variant, geomean speed vs default, vs cuBLAS")
        ranked = sorted(part["variants"].items(), key=lambda kv: -kv[1]["vs_default"])
        for kern, v in ranked:
            cub = f"{v['vs_cublas']:.2f}" if v["vs_cublas"] else "-"
            mark = "  WRONG/FAILED" if kern in summary["wrong_or_failed"] else ""
            lines.append(f"  {kern:<28} x{v['vs_default']:.3f}  x{cub}{mark}")
        for f, b in part["best"].items():
            tf, cub = b["tflops"] or 0, b["speed_vs_cublas"] or 0
            lines.append(
                f"  best {f:<24} {b['kernel']:<26} {b['us']:8.1f} us {tf:6.1f} TFLOP/s"
                f" x{cub:.2f} of cuBLAS"
            )
    return "\n".join(lines)


def _with_cublas_ratio(rows: list[dict]) -> list[dict]:
    """speed_vs_cublas = torch.matmul's time / this kernel's time at the same shape and M."""
    for r in rows:
        base = _cublas_us(rows, r)
        if base and "us" in r:
            r["speed_vs_cublas"] = base / r["us"]
    return rows


def _cublas_us(rows: list[dict], r: dict) -> float | None:
    for t in rows:
        if t["kernel"] == "torch" and t["file"] == r["file"] and t.get("m") == r.get("m"):
            return t.get("us")
    return None


def _line(r: dict, rows: list[dict]) -> str:
    if "error" in r:
        return f"{r['file']} {r['kernel']} M={r.get('m')}: ERROR {r['error'][-300:]}"
    base = _cublas_us(rows, r)
    return (
        f"{r['file']:<24} {r['kernel']:<26} M={r['m']:<5} {r['us']:9.1f} us "
        f"{r['tflops']:7.1f} TFLOP/s {r['weight_gbs']:7.0f} GB/s(W) "
        f"err {r['max_rel_err']:.2e}" + (f"  x{base / r['us']:.2f} of cuBLAS" if base else "")
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run", "measure"])
    p.add_argument("dir", type=Path)
    p.add_argument("file", nargs="?", help="measure only: library file")
    p.add_argument("kernels", nargs="*", help="measure only: kernel names or torch")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--shapes", default="4b,9b", help="build: model shapes (random_model.SHAPES)")
    p.add_argument(
        "--baselines", action="store_true", help="build: also dlight's SIMT and GEMV kernels"
    )
    p.add_argument("--only", help="build: kernels matching one of these globs (a,b*,...)")
    p.add_argument("--timeout", type=int, default=300, help="seconds a child process (run)")
    p.add_argument("--ms", help="run: prefill M values alone, e.g. 1024,2048,4096")
    p.add_argument("--reverse", action="store_true", help="run: each M's kernels last to first")
    args = p.parse_args()
    if args.ms:
        os.environ["GEMM_BENCH_MS"] = args.ms
    if args.reverse:
        os.environ["GEMM_BENCH_REVERSE"] = "1"
    if args.step == "build":
        build(args.dir, args.arch, tuple(args.shapes.split(",")), args.baselines, args.only)
    elif args.step == "run":
        run(args.dir, args.timeout)
    else:
        _measure(args.dir, args.file, args.kernels)


if __name__ == "__main__":
    main()
