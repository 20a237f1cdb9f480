"""Benchmark of the logits projection kernel alone against torch F.linear (cuBLAS).

Two steps, because the GPU server has no compiler:
  here (nvcc, no GPU):  python benchmarks/logits_kernel.py build DIR [--arch sm_80,sm_90]
  on the GPU server:    python benchmarks/logits_kernel.py run DIR

`run` prints, for hidden 2560 and 4096 and batch 1, 16, 17, 64, 65, the time and the weight
bytes read per second as a fraction of the device-to-device copy bandwidth measured in the same run
(copy bandwidth = bytes read + written per second, so a pure stream reaches about 100%), at
width 248,077 (unpadded) and 248,192 (padded, pad columns masked). The kernel also leaves the
triples of each row's greedy pick; the pick kernel that merges them is timed after it (`pick
µs`) and checked: the argmax and log-softmax of the decodable columns, as torch finds them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import copy_bandwidth, cuda_time

ROWS, DECODABLE, SELECTION = 248_320, 248_077, 248_192
HIDDENS = (2560, 4096)
BATCHES = (1, 16, 17, 64, 65)  # 17, 65: the 64-row kernel part-filled, and in two passes
VARIANTS = {"unpadded": (DECODABLE, DECODABLE), "padded": (DECODABLE, SELECTION)}


def build(out: Path, arch: str) -> None:
    import tvm

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.greedy import greedy_pick
    from qwen35_tvm.schedules.logits import logits_projection

    target, arches = make_target("cuda", arch)
    prepare_cuda_codegen(arches)
    out.mkdir(parents=True, exist_ok=True)
    for hidden in HIDDENS:
        for name, (decodable, selection) in VARIANTS.items():
            func = logits_projection(hidden, ROWS, decodable, selection, "bfloat16", target)
            pick = greedy_pick(decodable, selection, target)
            lib = tvm.compile(tvm.IRModule({"logits": func, "greedy_pick": pick}), target=target)
            lib.export_library(str(out / f"logits_{hidden}_{name}.so"))
    from qwen35_tvm.schedules.pick_triples import CHUNK_COLS

    # the run side has TVM's runtime only (no tvm.script): it reads the triples' chunk here
    meta = {"arch": arches, "pick_chunk_cols": CHUNK_COLS}
    (out / "logits_bench.json").write_text(json.dumps(meta))


def run(out: Path) -> None:
    import os

    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm

    from qwen35_tvm.runtime.artifact import device_of

    device_of("cuda")  # loads TVM's CUDA runtime
    chunk_cols = json.loads((out / "logits_bench.json").read_text())["pick_chunk_cols"]
    bw = copy_bandwidth(torch)
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| hidden | B | width | kernel | time (µs) | weight GB/s | of copy bw | pick µs |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for hidden in HIDDENS:
        weight = torch.randn(ROWS, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        for batch in BATCHES:
            x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
            for name, (decodable, selection) in VARIANTS.items():
                lib = tvm.runtime.load_module(str(out / f"logits_{hidden}_{name}.so"))
                fn, pick = lib["logits"], lib["greedy_pick"]
                res = torch.empty(batch, selection, device="cuda", dtype=torch.float32)
                chunks = -(-selection // chunk_cols)
                ws_val = torch.empty(batch, chunks, 2, device="cuda", dtype=torch.float32)
                ws_idx = torch.empty(batch, chunks, device="cuda", dtype=torch.int32)
                best = torch.empty(batch, device="cuda", dtype=torch.int32)
                logprob = torch.empty(batch, device="cuda", dtype=torch.float32)
                args = [tvm.runtime.from_dlpack(t) for t in (x, weight, res, ws_val, ws_idx)]
                pick_args = [tvm.runtime.from_dlpack(t) for t in (ws_val, ws_idx, best, logprob)]
                ours = cuda_time(torch, lambda fn=fn, args=args: fn(*args))
                pick_t = cuda_time(torch, lambda f=pick, a=pick_args: f(*a))
                ref = torch.nn.functional.linear(x.float(), weight[:decodable].float())
                err = (res[:, :decodable] - ref).abs().max().item()
                # the pick of what the kernel wrote (its own rounding), not of the fp32 reference
                mine = res[:, :decodable].double()
                pick_ok = bool((best.long() == mine.argmax(dim=1)).all())
                picked = best.long().clamp(0, decodable - 1)[:, None]
                want_lp = mine.log_softmax(dim=1).gather(1, picked)[:, 0]
                lp_err = (logprob.double() - want_lp).abs().max().item()
                pads_ok = (
                    bool(torch.isneginf(res[:, decodable:]).all())
                    if selection > decodable
                    else True
                )
                w_slice = weight[:selection]
                cublas = cuda_time(torch, lambda x=x, w=w_slice: torch.nn.functional.linear(x, w))
                for kernel, t in ((f"ours ({name})", ours), ("torch F.linear", cublas)):
                    gbs = selection * hidden * 2 / t
                    rows.append(
                        dict(
                            hidden=hidden,
                            batch=batch,
                            width=selection,
                            kernel=kernel,
                            us=t * 1e6,
                            frac=gbs / bw,
                            max_err=err,
                            pads_ok=pads_ok,
                            pick_us=pick_t * 1e6 if kernel.startswith("ours") else None,
                            pick_ok=pick_ok,
                            pick_logprob_err=lp_err,
                        )
                    )
                    pick_col = f"{pick_t * 1e6:.1f}" if kernel.startswith("ours") else ""
                    print(
                        f"| {hidden} | {batch} | {selection} | {kernel} | {t * 1e6:.1f} | "
                        f"{gbs / 1e9:.0f} | {gbs / bw:.1%} | {pick_col} |"
                    )
                print(
                    f"  check {name} B={batch} h={hidden}: max |ours - fp32 ref| = {err:.3g}, "
                    f"pads -inf: {pads_ok}, pick = argmax: {pick_ok}, "
                    f"logprob max |err| {lp_err:.3g}",
                    file=sys.stderr,
                )
    (out / "logits_bench_result.json").write_text(json.dumps({"copy_bw": bw, "rows": rows}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run"])
    p.add_argument("dir", type=Path)
    p.add_argument("--arch", default="sm_80,sm_90")
    args = p.parse_args()
    build(args.dir, args.arch) if args.step == "build" else run(args.dir)


if __name__ == "__main__":
    main()
