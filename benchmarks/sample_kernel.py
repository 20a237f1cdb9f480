"""The device's sampled pick (schedules/sample_pick.py) on the GPU, at Qwen3.5's vocabulary
(248,077 decodable of 248,192 columns), against its numpy reference and against the host's
sampler it replaces.

  here (nvcc, no GPU):  python benchmarks/sample_kernel.py build DIR
  on the GPU server:    python benchmarks/sample_kernel.py run DIR [--out docs/results]

For 1 and 16 rows of random logits (flat: std 1; peaked: std 4), pads holding the largest
values, and each setting (Qwen3.5's suggested t0.7 / p0.8 / k20, its thinking t1.0 / p0.95 /
k20, top_k 64, Gumbel-max over the whole row, top_p alone at t1.0 / p0.9 and t0.7 / p0.95, and
min_p 0.05 alone and 0.1 with the suggested settings):
the GPU check (every token equal to tests/sampling_reference.py's draw on the same row, seed
and position; never a pad; the logprob within 1e-4 of the row's log_softmax; top_p rows'
nucleus floors against the reference's, reported), then µs a call in a CUDA graph, and the host's
path for one row on this machine's CPU: the row's copy to the host, Sampler.sample and
Sampler.logprob (what a sampled row paid each step before; its step was synchronous too).
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

from common import build_or_run, write_result

DECODABLE, SELECTION = 248077, 248192
SETTINGS = {  # name: (temperature, top_p, top_k[, min_p])
    "suggested": (0.7, 0.8, 20),
    "thinking": (1.0, 0.95, 20),
    "top_k_64": (1.0, 1.0, 64),
    "gumbel": (1.0, 1.0, -1),
    "top_p": (1.0, 0.9, -1),  # top_p alone, as OpenAI clients send it: the nucleus kernel
    "top_p_t0.7": (0.7, 0.95, -1),
    "min_p": (1.0, 1.0, -1, 0.05),  # min_p over the whole row: the nucleus form's peak
    "top_k_min_p": (0.7, 0.8, 20, 0.1),
}
ROWS = (1, 16)
MANIFEST = "manifest.json"


def build(out: Path) -> None:
    import tvm

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.pipeline import tir_pipeline
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules import draw_hash, nucleus, sample_pick

    target, arches = make_target("cuda", "sm_90")
    prepare_cuda_codegen(arches)
    funcs = {name: sample_pick.sample_pick(DECODABLE, SELECTION, target, nucleus_rows=rows)
             for name, rows in (("sample_pick", True), ("sample_pick_plain", False))}  # fmt: skip
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})
    lib = tvm.compile(mod, target=target, tir_pipeline=tir_pipeline(target))
    out.mkdir(parents=True, exist_ok=True)
    lib.export_library(str(out / "sample_pick.so"))
    # the run side reads the kernel's constants here: it imports no compiler (tvm.script)
    consts = {"DRAW": draw_hash.DRAW, "K_MAX": sample_pick.K_MAX, "MIX": draw_hash.MIX,
              "CHUNKS": sample_pick.CHUNKS, "FIXED": nucleus.FIXED,
              "LOG2E": nucleus.LOG2E,  # a row's workspaces: (shape past n, dtype)
              "WORKSPACES": [(s[1:], dt) for s, dt in sample_pick.workspace_shapes(1)]}  # fmt: skip
    (out / MANIFEST).write_text(json.dumps({"arch": arches, "constants": consts}))
    print(f"built {out / 'sample_pick.so'}")


def _reference_module(consts: dict):
    """tests/sampling_reference.py, its kernel constants from the manifest."""
    sys.modules["qwen35_tvm.schedules.sample_pick"] = types.SimpleNamespace(**consts)
    sys.modules["qwen35_tvm.schedules.nucleus"] = types.SimpleNamespace(**consts)
    sys.modules["qwen35_tvm.schedules.draw_hash"] = types.SimpleNamespace(**consts)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import sampling_reference

    return sampling_reference


def _case(torch, tvm, lib, ref, consts, scale: float, n: int, setting: str, gen) -> dict:
    from qwen35_tvm.runtime.device_sampling import seed_words

    t, p, k, min_p = (*SETTINGS[setting], 0.0)[:4]
    logits = torch.randn((n, SELECTION), device="cuda", generator=gen) * scale
    logits[:, DECODABLE:] = 1e4  # a leak would win every draw
    rows = torch.arange(n, device="cuda", dtype=torch.int32).flip(0)
    seeds = [1000 * n + 17 * j for j in range(n)]
    words = [seed_words(s) for s in seeds]
    floats = torch.tensor([[t, p, min_p]] * n, device="cuda", dtype=torch.float32)
    ints = torch.tensor([[k, lo, hi, 1024 + j] for j, (lo, hi) in enumerate(words)],
                        device="cuda", dtype=torch.int32)  # fmt: skip
    best = torch.full((n,), -1, device="cuda", dtype=torch.int32)
    logprob = torch.zeros((n,), device="cuda", dtype=torch.float32)
    ws = [torch.empty((n, *shape), device="cuda", dtype=getattr(torch, dt))
          for shape, dt in consts["WORKSPACES"]]  # fmt: skip
    args = [tvm.runtime.from_dlpack(a) for a in (logits, rows, floats, ints, best, logprob, *ws)]
    # the function the runtime calls: the nucleus kernels only for top_p or min_p, top_k off
    floored = k < 1 and (p < 1 or min_p > 0)
    fn = lib["sample_pick" if floored else "sample_pick_plain"]
    fn(*args)
    torch.cuda.synchronize()
    host = logits.cpu().numpy()
    got, got_lp = best.cpu().numpy(), logprob.cpu().numpy()
    lsm = torch.log_softmax(logits[:, :DECODABLE].double(), dim=1).cpu().numpy()
    floors = ws[3].cpu().numpy()  # the nucleus's first workspace
    equal, floors_equal, lp_err, kept = 0, 0, 0.0, []
    for j in range(n):
        r = n - 1 - j  # rows are listed in reverse
        want, _ = ref.draw(host[r], DECODABLE, t, p, k, *words[j], 1024 + j, min_p)
        equal += int(got[r] == want)
        lp_err = max(lp_err, abs(float(got_lp[r]) - float(lsm[r, got[r]])))
        if k < 1 and p < 1:
            floor = ref.nucleus_floor(host[r, :DECODABLE], t, p)
            floors_equal += int(floors[j] == floor)
            kept.append(int((host[r, :DECODABLE] >= floors[j]).sum()))
    row = {"setting": setting, "scale": scale, "rows": n, "tokens_equal": equal,
           "never_a_pad": bool((got < DECODABLE).all()), "logprob_max_err": lp_err}  # fmt: skip
    if kept:
        row |= {"floors_equal": floors_equal, "nucleus_columns_max": max(kept)}
    graph = torch.cuda.CUDAGraph()
    import tvm_ffi

    with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
        for _ in range(10):
            fn(*args)
    from common import cuda_time

    row["device_us"] = cuda_time(torch, graph.replay, iters=20) / 10 * 1e6
    if not floored:  # what the nucleus kernels' five launches would add to such a row
        graph = torch.cuda.CUDAGraph()
        with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
            for _ in range(10):
                lib["sample_pick"](*args)
        row["device_us_nucleus_form"] = cuda_time(torch, graph.replay, iters=20) / 10 * 1e6
    row |= _host_path(torch, logits[0], (t, p, k, min_p))
    print(json.dumps(row), flush=True)
    return row


def _host_path(torch, row_gpu, setting) -> dict:
    """The host's sampler on one row: copy, sample, logprob (median of 20)."""
    import numpy as np

    from qwen35_tvm.runtime.sampler import Sampler, SamplingParams

    sampler, params = Sampler(DECODABLE), SamplingParams(*setting)
    rng, times = np.random.default_rng(0), []
    for _ in range(20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        row = row_gpu.cpu().numpy()
        token = sampler.sample(row, params, rng)
        sampler.logprob(row, token)
        times.append(time.perf_counter() - start)
    return {"host_row_us": float(np.median(times)) * 1e6}


def run(out: Path, results: Path | None) -> None:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm

    from qwen35_tvm.runtime.artifact import device_of

    device_of("cuda")
    consts = json.loads((out / MANIFEST).read_text())["constants"]
    consts["MIX"] = tuple(consts["MIX"])
    ref = _reference_module(consts)
    lib = tvm.runtime.load_module(str(out / "sample_pick.so"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [_case(torch, tvm, lib, ref, consts, scale, n, s, gen)
            for scale in (1.0, 4.0) for n in ROWS for s in SETTINGS]  # fmt: skip
    print("| setting | logits std | rows | tokens equal | device µs | nucleus form µs |"
          " host µs a row |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        other = r.get("device_us_nucleus_form")
        print(f"| {r['setting']} | {r['scale']:g} | {r['rows']} | {r['tokens_equal']}/{r['rows']}"
              f" | {r['device_us']:.1f} | {'' if other is None else f'{other:.1f}'}"
              f" | {r['host_row_us']:.0f} |")  # fmt: skip
    result = {"device": torch.cuda.get_device_name(), "rows": rows}
    write_result("sample_kernel.json", result, out, results)
    bad = [r for r in rows if r["tokens_equal"] < r["rows"] or not r["never_a_pad"]
           or r["logprob_max_err"] > 1e-4]  # fmt: skip
    if bad:
        sys.exit(f"{len(bad)} cases differ from the reference, drew a pad or a wrong logprob")


if __name__ == "__main__":
    build_or_run(__doc__, build, run)
