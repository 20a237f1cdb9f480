"""What a grid barrier costs against a kernel boundary (schedules/grid_barrier.py): the probe's
16 dependent phases, each streaming a slice of constant data per block as a decode GEMV streams
its weight, run as one kernel with a grid barrier between phases ("fused") and as 16 kernels
that each wait for the one before (programmatic dependent launch, "chain"), both loading a
thread's first `ahead` vectors before they wait; in CUDA graphs.

  here (nvcc, no GPU):  python benchmarks/grid_chain.py build DIR
  on the GPU server:    python benchmarks/grid_chain.py run DIR [--out docs/results]

Phase sizes: "tiny" (1.1 MB: the barrier or boundary alone), 21.6 MB (4B's o_proj) and
47.6 MB (4B's down), on grids of 132 and 264 blocks; 16 phases of data fill several times the
L2, so every phase streams from HBM. `run` checks each result exactly against torch (int32
sums; a missing barrier reads another block's result too early) and that the barrier's words
are back to zero, then reports µs a phase (graph wall time / phases), % of the copy bandwidth
of the same run, and fused minus chain: the time a barrier saves over a boundary, or costs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from common import build_or_run, write_result

PHASES = 16
GRIDS = (132, 264)  # H100/H200 SXM: one block an SM, two
SIZES = {"tiny": 1, "o_proj": 20, "down": 44}  # 128-bit loads a thread a phase at 264 blocks
AHEAD = (0, 8)
MANIFEST = "manifest.json"
GRAPH_CALLS = 8  # fused calls a graph (chain: 8 x 16 launches)


def _name(kind: str, size: str, blocks: int, ahead: int) -> str:
    return f"{kind}_{size}_b{blocks}_a{ahead}"


def _per_thread(size: str, blocks: int) -> int:
    return SIZES[size] * GRIDS[-1] // blocks  # the same bytes a phase on either grid


def build(out: Path) -> None:
    import tvm

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.pipeline import tir_pipeline
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules.grid_barrier import THREADS, VEC, WORDS, streaming_phases

    target, arches = make_target("cuda", "sm_90")  # griddepcontrol: sm_90's
    prepare_cuda_codegen(arches)
    funcs = {}
    for size in SIZES:
        for blocks in GRIDS:
            for ahead in AHEAD:
                for kind in ("fused", "chain"):
                    f = streaming_phases(PHASES, blocks, _per_thread(size, blocks), True,
                                         kind == "fused", ahead)  # fmt: skip
                    name = _name(kind, size, blocks, ahead)
                    funcs[name] = f.with_attr("global_symbol", name)
    out.mkdir(parents=True, exist_ok=True)
    lib = tvm.compile(tvm.IRModule(funcs), target=target, tir_pipeline=tir_pipeline(target))
    lib.export_library(str(out / "grid_chain.so"))
    # the run side reads the layout here: it imports no compiler (tvm.script)
    manifest = {"arch": arches, "sizes": SIZES, "grids": GRIDS, "ahead": AHEAD,
                "threads": THREADS, "vec": VEC, "words": WORDS}  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest))
    print(f"built {out / 'grid_chain.so'}: {sorted(funcs)}")


def _reference(torch, data):
    """out[p, b] = sum of block b's slice of phase p + out[p - 1, (b + 1) % blocks]."""
    sums = data.sum(dim=(2, 3), dtype=torch.int64)
    out = torch.zeros_like(sums)
    for p in range(PHASES):
        out[p] = sums[p] + (out[p - 1].roll(-1) if p else 0)
    return out.to(torch.int32)


def _measure_case(
    torch, tvm_ffi, lib, gen, bw: float, size: str, blocks: int, layout: dict
) -> list[dict]:
    """Both forms at each `ahead` for one phase size and grid: exact checks, then µs a phase."""
    import tvm
    from common import cuda_time

    THREADS, VEC, WORDS = layout["threads"], layout["vec"], layout["words"]  # noqa: N806
    dl = tvm.runtime.from_dlpack
    per_thread = _per_thread(size, blocks)
    data = torch.randint(0, 8, (PHASES, blocks, per_thread, THREADS * VEC), device="cuda",
                         dtype=torch.int32, generator=gen)  # fmt: skip
    want = _reference(torch, data)
    phase_bytes = data[0].numel() * 4
    res = torch.full((PHASES, blocks), -1, device="cuda", dtype=torch.int32)
    words = torch.zeros(WORDS, device="cuda", dtype=torch.int32)
    d, o, w = dl(data), dl(res), dl(words)
    rows = []
    for ahead in AHEAD:
        for kind in ("fused", "chain"):
            name = _name(kind, size, blocks, ahead)
            fn = lib[name]
            if kind == "fused":
                calls = [lambda fn=fn: fn(d, o, w)]
            else:
                calls = [lambda fn=fn, p=p: fn(p, d, o) for p in range(PHASES)]
            res.fill_(-1)
            for c in calls:
                c()
            torch.cuda.synchronize()
            row = {"case": name, "kind": kind, "size": size, "blocks": blocks, "ahead": ahead,
                   "phase_bytes": phase_bytes, "copy_bw_tbs": bw / 1e12,
                   "exact": bool(torch.equal(res, want)),
                   "words_zero": bool((words == 0).all().item())}  # fmt: skip
            try:
                graph = torch.cuda.CUDAGraph()
                with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
                    for _ in range(GRAPH_CALLS):
                        for c in calls:
                            c()
                seconds = cuda_time(torch, graph.replay, iters=10) / GRAPH_CALLS
                row["us_per_phase"] = seconds / PHASES * 1e6
                row["pct_copy_bw"] = 100 * phase_bytes * PHASES / seconds / bw
                row["exact_after_graph"] = bool(torch.equal(res, want))
                row["words_zero"] = row["words_zero"] and bool((words == 0).all().item())
            except Exception as err:  # noqa: BLE001  report, go on
                row["error"] = f"{type(err).__name__}: {err}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run(out: Path, results: Path | None) -> None:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm
    import tvm_ffi
    from common import copy_bandwidth

    from qwen35_tvm.runtime.artifact import device_of

    device_of("cuda")
    bw = copy_bandwidth(torch)
    lib = tvm.runtime.load_module(str(out / "grid_chain.so"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    layout = json.loads((out / MANIFEST).read_text())
    rows = []
    for size in SIZES:
        for blocks in GRIDS:
            rows += _measure_case(torch, tvm_ffi, lib, gen, bw, size, blocks, layout)
    by = {r["case"]: r for r in rows}
    print("| phase | blocks | ahead | fused µs/phase | chain µs/phase | fused − chain |"
          " fused % bw | chain % bw | exact |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for size in SIZES:
        for blocks in GRIDS:
            for ahead in AHEAD:
                f = by[_name("fused", size, blocks, ahead)]
                c = by[_name("chain", size, blocks, ahead)]
                if "us_per_phase" in f and "us_per_phase" in c:
                    print(f"| {size} | {blocks} | {ahead} | {f['us_per_phase']:.2f} | "
                          f"{c['us_per_phase']:.2f} | "
                          f"{f['us_per_phase'] - c['us_per_phase']:+.2f} | "
                          f"{f['pct_copy_bw']:.1f} | {c['pct_copy_bw']:.1f} | "
                          f"{f['exact'] and c['exact']} |")  # fmt: skip
    result = {"device": torch.cuda.get_device_name(), "rows": rows}
    write_result("grid_chain.json", result, out, results)
    if not all(r["exact"] and r["words_zero"] for r in rows):
        sys.exit("a result differs from torch's, or the barrier's words were left nonzero")


if __name__ == "__main__":
    build_or_run(__doc__, build, run)
