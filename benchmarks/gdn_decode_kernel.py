"""Benchmark of a decode step's Gated DeltaNet core: the fused kernel (schedules/gdn_decode.py)
against the kernels it replaces, gdn_input, the recurrent delta rule and the gated norm.

Two steps, because the GPU server has no compiler:
  here (nvcc, no GPU):  python benchmarks/gdn_decode_kernel.py build DIR [--arch sm_90]
  on the GPU server:    python benchmarks/gdn_decode_kernel.py run DIR [--out docs/results]

At the 4B shapes (bf16 in_proj rows, 16 key heads, 32 value heads, head dims 128, conv width 4),
1, 16 and 64 sequences of one token in scattered slots. Each row checks the fused kernel
against the two-kernel path on the same GPU (max relative difference of outputs and states,
bound 1e-5: the same arithmetic in the same order, bit-equal on the CPU, where nvcc may
contract a multiply-add differently) and against a
float64 torch reference of conv, norms, gates and recurrence (bound 1e-2: the conv output is
rounded to bf16, where float64 can land on the neighbouring value). `fused` is decode's kernel,
with the gated norm: its output is checked against gated_norm's on the two-kernel output (bound
1e-2: bf16 outputs), its conv history against gated_norm's move of it, and its tickets must be
zero again after it. Times are CUPTI kernel times (fused, and gdn_input + recurrent + gated
norm); the state's bytes (read and written) over the copy bandwidth of the same run give the
fused kernel's share of it. `fused_wide` is decode_wide's kernel (gdn_decode.WIDE_LAYOUT, no
gated norm), checked against the float64 reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from common import copy_bandwidth
from gdn_kernel import (
    K_DIM,
    K_HEADS,
    LAYER,
    N_LAYERS,
    N_SLOTS,
    V_DIM,
    V_HEADS,
    kernel_time_us,
    torch_reference,
)

KERNEL = 4
KEY_DIM, VALUE_DIM = K_HEADS * K_DIM, V_HEADS * V_DIM
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
WIDTH = CONV_DIM + VALUE_DIM + 2 * V_HEADS
BATCHES = (1, 16, 64)
KERNELS = ("fused", "input", "recurrent", "norm", "fused_wide")
EPS = 1e-6


def build(out: Path, arch: str) -> None:
    import tvm

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.gdn import gated_delta_rule
    from qwen35_tvm.schedules.gdn_decode import WIDE_LAYOUT, decode_delta_rule
    from qwen35_tvm.schedules.gdn_prep import gated_norm, gdn_input

    target, arches = make_target("cuda", arch)
    prepare_cuda_codegen(arches)
    out.mkdir(parents=True, exist_ok=True)
    dims = (K_HEADS, V_HEADS, K_DIM, V_DIM)
    funcs = {
        "fused": decode_delta_rule(*dims, KERNEL, EPS, "bfloat16", target),
        "input": gdn_input(*dims, KERNEL, "bfloat16", target),
        "recurrent": gated_delta_rule(*dims, target),
        "norm": gated_norm(V_HEADS, V_DIM, CONV_DIM, KERNEL, EPS, "bfloat16", target),
        "fused_wide": decode_delta_rule(
            *dims, KERNEL, EPS, "bfloat16", target, **WIDE_LAYOUT, gated=False
        ),
    }
    for name, func in funcs.items():
        func = func.with_attr("global_symbol", "main")
        lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
        lib.export_library(str(out / f"gdn_decode_{name}.so"))
    (out / "gdn_decode_bench.json").write_text(json.dumps({"arch": arches}))


def make_inputs(torch, batch: int, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    bf16 = torch.bfloat16
    slots = torch.randperm(N_SLOTS, device="cuda", generator=gen)[:batch].to(torch.int32)
    return {
        "x": randn(batch, WIDTH, scale=2.0, dtype=bf16),
        "w": randn(CONV_DIM, KERNEL, scale=0.5, dtype=bf16),
        "a_log": randn(V_HEADS),
        "dt_bias": randn(V_HEADS),
        "indptr": torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        "slots": slots,
        "conv": randn(N_SLOTS, N_LAYERS, CONV_DIM, KERNEL - 1, dtype=bf16),
        "pool": randn(N_SLOTS, N_LAYERS, V_HEADS, V_DIM, K_DIM, scale=0.5),
        "norm_w": randn(V_DIM, scale=0.3) + 1.0,
    }


def reference(torch, inp: dict) -> tuple:
    """float64: the conv (rounded to bf16), norms and gates, then gdn_kernel's recurrence."""
    x = inp["x"].double()
    hist = inp["conv"][inp["slots"].long(), LAYER].double()  # [batch, conv_dim, kernel - 1]
    window = torch.cat([hist, x[:, :CONV_DIM, None]], dim=2)
    acc = (window * inp["w"].double()).sum(-1)
    conv = (acc * torch.sigmoid(acc)).to(torch.bfloat16).double()
    batch = x.shape[0]

    def unit(a):
        return a / torch.sqrt((a * a).sum(-1, keepdim=True) + 1e-6)

    a = x[:, CONV_DIM + VALUE_DIM + V_HEADS :] + inp["dt_bias"].double()
    staged = {
        "q": unit(conv[:, :KEY_DIM].reshape(batch, K_HEADS, K_DIM)),
        "k": unit(conv[:, KEY_DIM : 2 * KEY_DIM].reshape(batch, K_HEADS, K_DIM)),
        "v": conv[:, 2 * KEY_DIM :].reshape(batch, V_HEADS, V_DIM),
        "g": -torch.exp(inp["a_log"].double()) * torch.nn.functional.softplus(a),
        "beta": torch.sigmoid(x[:, CONV_DIM + VALUE_DIM : CONV_DIM + VALUE_DIM + V_HEADS]),
    }
    return torch_reference(torch, {**inp, **staged})


def rel(got, ref) -> float:
    """max |got - ref| over max |ref|."""
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def run(out_dir: Path, results: Path | None) -> None:
    import os

    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm

    from qwen35_tvm.runtime.artifact import device_of

    device_of("cuda")
    fns = {
        name: tvm.runtime.load_module(str(out_dir / f"gdn_decode_{name}.so"))["main"]
        for name in KERNELS
    }
    dl = tvm.runtime.from_dlpack
    bw = copy_bandwidth(torch)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s")
    rows = []
    for batch in BATCHES:
        row = {"batch": batch}
        try:
            inp = make_inputs(torch, batch, seed=batch)
            f32 = torch.float32
            staged = [torch.empty(batch, K_HEADS, K_DIM, device="cuda", dtype=f32) for _ in "qk"]
            staged += [torch.empty(batch, V_HEADS, V_DIM, device="cuda", dtype=f32)]
            staged += [torch.empty(batch, V_HEADS, device="cuda", dtype=f32) for _ in "gb"]
            pools = {name: inp["pool"].clone() for name in ("fused", "two", "fused_wide")}
            outs = {name: torch.empty(batch, V_HEADS, V_DIM, device="cuda") for name in pools}
            convs = {name: inp["conv"].clone() for name in ("fused", "two")}
            gated = {name: torch.empty(batch, VALUE_DIM, device="cuda", dtype=torch.bfloat16)
                     for name in ("fused", "two")}  # fmt: skip
            tickets = torch.zeros(N_SLOTS, K_HEADS + V_HEADS, device="cuda", dtype=torch.int32)
            common = [dl(inp[k]) for k in ("x", "w", "a_log", "dt_bias")]
            calls = {
                "fused": [*common, dl(inp["norm_w"]), dl(inp["slots"]), dl(convs["fused"]),
                          dl(pools["fused"]), dl(tickets), LAYER, dl(outs["fused"]),
                          dl(gated["fused"])],
                "fused_wide": [*common, dl(inp["slots"]), dl(inp["conv"]),
                               dl(pools["fused_wide"]), LAYER, dl(outs["fused_wide"])],
                "input": [*common, dl(inp["indptr"]), dl(inp["slots"]), dl(inp["conv"]), LAYER,
                          *(dl(t) for t in staged)],
                "recurrent": [*(dl(t) for t in staged), dl(inp["indptr"]), dl(inp["slots"]),
                              dl(pools["two"]), LAYER, dl(outs["two"])],
                "norm": [dl(outs["two"]), dl(inp["x"]), dl(inp["norm_w"]), dl(inp["indptr"]),
                         dl(inp["slots"]), dl(convs["two"]), LAYER, dl(gated["two"])],
            }  # fmt: skip
            for name in KERNELS:
                fns[name](*calls[name])
            torch.cuda.synchronize()
            # decode's kernel: its gated norm and conv history as gated_norm's, its tickets reset
            row["rel_gated_vs_two"] = rel(gated["fused"], gated["two"])
            row["conv_history_equal"] = bool(torch.equal(convs["fused"], convs["two"]))
            row["tickets_zero"] = not bool(tickets.any())
            exact_out, exact_pool = reference(torch, inp)
            touched = exact_pool[inp["slots"].long(), LAYER]
            for name, o in outs.items():
                p = pools[name][inp["slots"].long(), LAYER].double()
                row[f"rel_out_{name}"] = rel(o, exact_out)
                row[f"rel_state_{name}"] = rel(p, touched)
            two_out, two_pool = outs["two"], pools["two"]
            row["rel_out_vs_two"] = rel(outs["fused"], two_out)
            row["rel_state_vs_two"] = rel(pools["fused"], two_pool)
            row["ok"] = max(row["rel_out_vs_two"], row["rel_state_vs_two"]) < 1e-5 and max(
                row["rel_out_fused"], row["rel_state_fused"], row["rel_out_fused_wide"],
                row["rel_state_fused_wide"], row["rel_gated_vs_two"]) < 1e-2 and row[
                "conv_history_equal"] and row["tickets_zero"]  # fmt: skip
            for name in KERNELS:  # timing re-runs the calls: the values no longer matter
                row[f"{name}_us"] = kernel_time_us(torch, lambda f=fns[name], a=calls[name]: f(*a))
            row["replaced_us"] = row["input_us"] + row["recurrent_us"] + row["norm_us"]
            state_bytes = batch * V_HEADS * V_DIM * K_DIM * 4 * 2
            row["fused_copy_bw_fraction"] = state_bytes / (row["fused_us"] * 1e-6) / bw
            row["fused_wide_copy_bw_fraction"] = state_bytes / (row["fused_wide_us"] * 1e-6) / bw
        except Exception as err:
            traceback.print_exc()
            row["error"] = repr(err)[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "copy_bw_tbs": bw / 1e12, "rows": rows}
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        (results / "gdn_decode_kernel.json").write_text(json.dumps(result, indent=1))
    print("| batch | fused µs | gdn_input + recurrent + gated norm µs | fused % of copy bw | "
          "fused r32p4 µs (% of copy bw) | ok |\n|---|---|---|---|---|---|")  # fmt: skip
    nan = float("nan")
    for r in rows:
        share = 100 * r.get("fused_copy_bw_fraction", nan)
        other = 100 * r.get("fused_wide_copy_bw_fraction", nan)
        print(f"| {r['batch']} | {r.get('fused_us', nan):.1f} | {r.get('replaced_us', nan):.1f}"
              f" | {share:.0f}% | {r.get('fused_wide_us', nan):.1f} ({other:.0f}%)"
              f" | {r.get('ok')} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run"])
    p.add_argument("dir", type=Path)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    if args.step == "build":
        build(args.dir, args.arch)
    else:
        run(args.dir, args.out)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
