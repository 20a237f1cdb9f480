"""Benchmark of the projection GEMMs alone: our bf16 tensor-core kernel (schedules/matmul.py)
against torch.matmul (cuBLAS), at the 4B model's (N, K) shapes.

Two steps, because the GPU server has no compiler:
  here (nvcc, no GPU):  python benchmarks/gemm_kernel.py build DIR [--arch sm_90]
  on the GPU server:    python benchmarks/gemm_kernel.py run DIR

`build` takes each projection the way the model has it (`Linear`: bf16 x [M, K] times W [N, K]ᵀ
to fp32, cast to bf16; out_proj, o_proj and down_proj with the residual add FuseOps puts behind
them), fuses it with the CUDA pipeline's passes and compiles, per shape, the PrimFunc as:
  prefill  mma        our kernel as the pipeline builds it (GemmConfig defaults)
           mma_*      the same kernel with other tilings, to tune the default
           simt       dlight's gpu.Matmul on SIMT (what prefill ran before the kernel)
  decode   gemv       dlight's LowBatchGEMV (what decode runs now)
           simt       dlight's gpu.Matmul (what decode ran before prefill and decode were split)
`run` checks each against a fp32 torch reference (max |ours - ref| / max |ref|, cuBLAS's bf16
error beside it) and times it (best of 20, CUDA events) with torch.matmul(x, w.T) in bf16 in
the same process, M in {16, 128, 1024, 4096} for prefill and {1, 4, 16, 64} for decode. Each
kernel runs in its own child process, so a faulting kernel costs only its own rows. Prints a
table to stderr and the JSON (also written to DIR/gemm_bench_result.json) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

PREFILL_M = (16, 128, 1024, 4096)
DECODE_M = (1, 4, 16, 64)
# name -> GemmConfig fields; "mma" is the default the pipeline uses
VARIANTS = {
    "mma": {},
    "mma_s4": {"stages": 4},
    "mma_bk64": {"block_k": 64},
    "mma_128x256": {"block_n": 256, "warps_n": 4, "stages": 4},
    "mma_64x128_bk64": {"block_m": 64, "block_k": 64, "stages": 4},
}
MANIFEST = "gemm_bench.json"


def projections(shape: str = "4b") -> list[dict]:
    """The model's distinct (N, K, residual) projections, with the names that have them."""
    from qwen35_tvm.compile.config import ModelConfig
    from qwen35_tvm.compile.random_model import SHAPES

    c = ModelConfig.from_hf(SHAPES[shape])
    nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    hv = c.linear_num_value_heads
    named = [
        ("in_proj", c.conv_dim + c.value_dim + 2 * hv, c.hidden_size, False),
        ("out_proj", c.hidden_size, c.value_dim, True),
        ("qkv_proj", (2 * nh + 2 * nkv) * d, c.hidden_size, False),
        ("o_proj", c.hidden_size, nh * d, True),
        ("gate_up_proj", 2 * c.intermediate_size, c.hidden_size, False),
        ("down_proj", c.hidden_size, c.intermediate_size, True),
    ]
    out: dict[tuple, dict] = {}
    for name, n, k, res in named:
        out.setdefault((n, k, res), {"n": n, "k": k, "residual": res, "names": []})
        out[(n, k, res)]["names"].append(name)
    return list(out.values())


def _fused_pair(n: int, k: int, residual: bool, target):
    """The prefill ("large") and decode ("small") PrimFuncs the pipeline makes of the Linear."""
    import tvm
    from tvm.relax.frontend import nn

    from qwen35_tvm.compile.model import Linear
    from qwen35_tvm.compile.pipeline import fusion_passes
    from qwen35_tvm.schedules.matmul import ROWS_ATTR

    class Proj(nn.Module):
        def __init__(self):
            self.proj = Linear(k, n, "bfloat16")

        def prefill(self, x: nn.Tensor, res: nn.Tensor) -> nn.Tensor:
            return res + self.proj(x) if residual else self.proj(x)

        decode = prefill

    spec = {
        name: {
            "x": nn.spec.Tensor([rows, k], "bfloat16"),
            "res": nn.spec.Tensor([rows, n], "bfloat16"),
            "$": {"param_mode": "plain"},
        }
        for name, rows in (("prefill", "n_tok"), ("decode", "batch"))
    }
    with target:
        mod, _ = Proj().export_tvm(spec=spec)
        mod = tvm.transform.Sequential(fusion_passes(target))(mod)
    found = {}
    for _, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs.get(ROWS_ATTR):
            found[str(func.attrs[ROWS_ATTR])] = func
    return found["large"], found["small"]


def _roles(func) -> dict[str, int]:
    from qwen35_tvm.schedules.gemm_match import match_gemm

    m = match_gemm(func)
    roles = {"x": m.a_param, "w": m.b_param, "out": m.out_param}
    if m.extra_params:
        roles["res"] = m.extra_params[0]
    return roles


def _variants(n: int, k: int, residual: bool, target) -> tuple[dict, dict, dict]:
    """{kernel name: scheduled PrimFunc}, {kernel name: why it failed}, parameter roles."""
    from tvm.s_tir import dlight as dl

    from qwen35_tvm.schedules.matmul import GemmConfig, MatmulMMA, gemm_for

    large, small = _fused_pair(n, k, residual, target)

    def rule(r, func):
        sch = r.apply(func.with_attr("dlight.do_not_tensorize", True), target, False)
        return None if sch is None else sch.mod["main"]

    makers = {"prefill_mma": lambda: rule(MatmulMMA(), large)}
    for name, fields in VARIANTS.items():
        if name != "mma":
            makers[f"prefill_{name}"] = lambda f=fields: gemm_for(large, GemmConfig(**f))
    makers["prefill_simt"] = lambda: rule(dl.gpu.Matmul(), large)
    makers["decode_gemv"] = lambda: rule(dl.gpu.LowBatchGEMV(4), small)
    makers["decode_simt"] = lambda: rule(dl.gpu.Matmul(), small)
    kernels, errors = {}, {}
    for name, make in makers.items():
        try:
            with target:
                func = make()
            if func is None:
                raise RuntimeError("the rule did not apply")
            kernels[name] = func.with_attr("tirx.is_scheduled", True)
        except Exception as err:  # noqa: BLE001  keep building the others
            errors[name] = f"{type(err).__name__}: {err}"
    return kernels, errors, _roles(large)


def build(out: Path, arch: str) -> None:
    import tvm

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target

    target, arches = make_target("cuda", arch)
    prepare_cuda_codegen(arches)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for proj in projections():
        n, k, residual = proj["n"], proj["k"], proj["residual"]
        kernels, errors, roles = _variants(n, k, residual, target)
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


def _measure(out: Path, file: str, kernel: str) -> list[dict]:
    """In a child process: one kernel (or "torch") of one shape at every M."""
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm
    from common import cuda_time

    from qwen35_tvm.runtime.artifact import device_of

    manifest = json.loads((out / MANIFEST).read_text())
    entry = next(e for e in manifest["entries"] if e["file"] == file)
    n, k, roles = entry["n"], entry["k"], entry["roles"]
    device_of("cuda")  # loads TVM's CUDA runtime
    fn = None if kernel == "torch" else tvm.runtime.load_module(str(out / file))[kernel]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
    rows = []
    if kernel == "torch":
        ms = sorted({*PREFILL_M, *DECODE_M})
    else:
        ms = DECODE_M if kernel.startswith("decode") else PREFILL_M
    for m in ms:
        row = {"file": file, "kernel": kernel, "m": m, "n": n, "k": k}
        try:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            res = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
            ref = x.float() @ w.float().T
            if "res" in roles:
                ref += res.float()
            scale = ref.abs().max().item()
            if kernel == "torch":
                got = x @ w.T + res if "res" in roles else x @ w.T
                seconds = cuda_time(torch, lambda x=x: torch.matmul(x, w.T))
            else:
                got = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                named = {"x": x, "w": w, "res": res, "out": got}
                order = sorted(roles, key=roles.get)
                args = [tvm.runtime.from_dlpack(named[r]) for r in order]
                fn(*args)
                torch.cuda.synchronize()
                seconds = cuda_time(torch, lambda args=args: fn(*args))
            row.update(
                us=seconds * 1e6,
                tflops=2 * m * n * k / seconds / 1e12,
                weight_gbs=n * k * 2 / seconds / 1e9,
                max_rel_err=(got.float() - ref).abs().max().item() / scale,
            )
        except Exception as err:  # noqa: BLE001  report, go on with the next M
            row["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc(file=sys.stderr)
        rows.append(row)
    return rows


def run(out: Path, timeout: int) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    rows: list[dict] = []
    for entry in manifest["entries"]:
        for kernel in ["torch", *entry["kernels"]]:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "measure",
                str(out),
                entry["file"],
                kernel,
            ]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                got = [json.loads(line) for line in proc.stdout.splitlines() if line[:1] == "{"]
                if proc.returncode != 0 or not got:
                    error = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
                    got.append({"file": entry["file"], "kernel": kernel, "error": error})
            except subprocess.TimeoutExpired:
                got = [{"file": entry["file"], "kernel": kernel, "error": f"timeout {timeout}s"}]
            rows += got
            for r in got:
                print(_line(r, rows), file=sys.stderr, flush=True)
    result = {"arch": manifest["arch"], "rows": _with_cublas_ratio(rows)}
    (out / "gemm_bench_result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


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
    p.add_argument("kernel", nargs="?", help="measure only: kernel name or torch")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--timeout", type=int, default=600, help="seconds per kernel (run)")
    args = p.parse_args()
    if args.step == "build":
        build(args.dir, args.arch)
    elif args.step == "run":
        run(args.dir, args.timeout)
    else:
        for row in _measure(args.dir, args.file, args.kernel):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
