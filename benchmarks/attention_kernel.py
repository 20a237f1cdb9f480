"""Benchmark of our paged attention kernels against torch SDPA: decode's split kernels, SIMT
(schedules/attention.py) and tensor-core (schedules/attention_decode_mma.py), and the tensor-core
prefill (schedules/attention_prefill.py).

Two steps, because the GPU server has no compiler:
  here (nvcc, no GPU):  python benchmarks/attention_kernel.py build DIR [--arch sm_90]
  on the GPU server:    python benchmarks/attention_kernel.py run DIR [--out docs/results]

4B heads (16 query heads, 4 kv heads, head_dim 256), bf16. Decode: one query token a sequence at
the end of B sequences of L tokens whose pages are scattered over the pool (and a check case of
odd lengths); reported as K/V bytes
read per second over the copy bandwidth of the same run, from the call's time, from a CUDA graph
of calls (how the decode step runs it: no host launch gaps) and from its kernels' CUPTI times.
Prefill: a fresh causal prompt (or 16 ragged ones) attending to itself through the pages. torch
runs SDPA on contiguous K/V in the same run (GQA expanded): its default backend, whose kernels
are recorded, and its FlashAttention-2 backend forced. Every case is also checked against
SDPA's output times random output gates (max |Δ|). JSON: DIR/attention_bench_result.json and,
with --out, a copy there.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from common import copy_bandwidth, cuda_time

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 4, 256, 16
DECODE = {
    "B1xL32768": (1, 32768),
    "B16xL4096": (16, 4096),
    "B64xL1024": (64, 1024),
    "B8xL1152": (8, 1152),  # decode_wide's steps in the engine's benchmark (1,024 + 128)
    "B16xL1152": (16, 1152),
}
# a check: one token, page edges, pieces that end mid-tile (4,097 tokens: 13 pieces of 20
# pages, the last of 17), one page a piece
DECODE_ODD = {"odd_lengths": [1, 16, 17, 31, 33, 700, 4097]}
PREFILL = {
    "1x1024": [1024],
    "1x8192": [8192],
    "16x1024": [1024] * 16,
    "ragged_odd": [1000, 17, 333, 1],  # odd tile counts, partial tiles, one token: a check
}
# SIMT split kernel variants (schedules/attention.py): name -> (pages of keys a tile, split
# budget, dependent launch as the model's build gives it); "tp2" is what fp32 builds and groups
# of more than 16 heads run
DECODE_VARIANTS = {
    "tp2": (2, 128, True),
    "tp2_nopdl": (2, 128, False),
    "tp2_b132": (2, 132, True),  # 528 blocks at B=1: 4 on each of 132 SMs
    "tp3": (3, 128, True),
    "tp2_b256": (2, 256, True),
}
# tensor-core split kernel (schedules/attention_decode_mma.py): name -> (pages of keys a tile,
# cp.async stages, split budget); "tc2s2b96" is what bf16 decode runs
TC_DECODE_VARIANTS = {
    "tc2s2b96": (2, 2, 96),
    "tc1s4b96": (1, 4, 96),
    "tc1s3b96": (1, 3, 96),
    "tc1s2b128": (1, 2, 128),
    "tc2s3b64": (2, 3, 64),
}
# tensor-core prefill: name -> (pages of keys a tile, query tokens a block); "mma2q16" ships
MMA_VARIANTS = {"mma2q16": (2, 16), "mma4q16": (4, 16)}


def build(out: Path, arch: str) -> None:
    import tvm

    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen
    from qwen35_tvm.compile.pipeline import tir_pipeline
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.schedules import attention, kv_cache
    from qwen35_tvm.schedules.attention_decode_mma import paged_decode_mma
    from qwen35_tvm.schedules.attention_prefill import paged_prefill_mma

    target, arches = make_target("cuda", arch)
    prepare_cuda_codegen(arches)
    out.mkdir(parents=True, exist_ok=True)
    funcs = {"append": (kv_cache.append_kv(KV_HEADS, HEAD_DIM, "bfloat16", target), True)}
    for name, (tp, budget, pdl) in DECODE_VARIANTS.items():
        funcs[f"attend_{name}"] = (
            attention.paged_attention(HEADS, KV_HEADS, HEAD_DIM, "bfloat16", target, tp, budget),
            pdl,
        )
    for name, (tp, stages, budget) in TC_DECODE_VARIANTS.items():
        funcs[f"attend_{name}"] = (
            paged_decode_mma(HEADS, KV_HEADS, HEAD_DIM, target, tp, stages, budget),
            True,
        )
    for name, (tp, qt) in MMA_VARIANTS.items():
        funcs[f"attend_{name}"] = (
            paged_prefill_mma(HEADS, KV_HEADS, HEAD_DIM, target, tp, qt),
            True,
        )
    for name, (func, pdl) in funcs.items():
        # as the model's build: kernels that wait for their producer launch dependently
        pipeline = tir_pipeline(target) if pdl else "default"
        tvm.compile(
            tvm.IRModule({"main": func}), target=target, tir_pipeline=pipeline
        ).export_library(str(out / f"attn_{name}.so"))
        print(f"built {name}")
    (out / "attention_bench.json").write_text(json.dumps({"arch": arches}))


def make_case(torch, lengths: list[int], queries: list[int], seed: int = 0) -> dict:
    """Sequences of `lengths` tokens (K/V already cached) whose last `queries[b]` tokens query;
    pages of all sequences shuffled over one pool."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-n // PAGE) for n in lengths]
    total = sum(pages)
    order = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    width = max(pages)
    table = torch.zeros(len(lengths), width, dtype=torch.int32, device="cuda")
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = order[start : start + p]
        start += p
    shape = (1, total, KV_HEADS, PAGE, HEAD_DIM)
    kp = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    vp = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lengths, queries, strict=True)])
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(queries), 0)
    n_tok = int(indptr[-1])
    q = torch.randn(n_tok, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    # qkv_proj's rows, [q_0 gate_0 q_1 gate_1 ... | k | v]: the kernels read the gates there
    proj = torch.randn(n_tok, (2 * HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda",
                       generator=gen, dtype=torch.bfloat16)  # fmt: skip
    return {
        "q": q,
        "proj": proj,
        "indptr": indptr.to("cuda"),
        "slots": torch.arange(len(lengths), dtype=torch.int32, device="cuda"),
        "positions": positions.to(torch.int32).to("cuda"),
        "table": table,
        "kp": kp,
        "vp": vp,
        "lengths": lengths,
        "queries": queries,
    }


def contiguous_kv(torch, x: dict, b: int):
    """Sequence b's K and V as [1, kv_heads, L, head_dim]."""
    n = x["lengths"][b]
    pages = x["table"][b, : -(-n // PAGE)].long()
    k = x["kp"][0, pages].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM)[:, :n]
    v = x["vp"][0, pages].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, HEAD_DIM)[:, :n]
    return k[None].contiguous(), v[None].contiguous()


def sdpa_reference(torch, x: dict) -> tuple:
    """SDPA's output for every query token, and a closure timing SDPA on contiguous K/V."""
    f = torch.nn.functional
    outs, calls = [], []
    group = HEADS // KV_HEADS
    qi = 0
    same = len(set(x["lengths"])) == 1 and len(set(x["queries"])) == 1
    kvs = [contiguous_kv(torch, x, b) for b in range(len(x["lengths"]))]
    for b, (k, v) in enumerate(kvs):
        nq = x["queries"][b]
        q = x["q"][qi : qi + nq].permute(1, 0, 2)[None]
        causal = nq > 1
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        outs.append(f.scaled_dot_product_attention(q, ke, ve, is_causal=causal)[0].permute(1, 0, 2))
        qi += nq
    if same:  # time one batched call, as a server would issue it
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qb = x["q"].reshape(len(kvs), x["queries"][0], HEADS, HEAD_DIM).permute(0, 2, 1, 3)
        kb = torch.cat([k for k, _ in kvs]).repeat_interleave(group, 1)
        vb = torch.cat([v for _, v in kvs]).repeat_interleave(group, 1)
        causal = x["queries"][0] > 1
        calls.append(lambda: f.scaled_dot_product_attention(qb, kb, vb, is_causal=causal))

        def flash():  # torch's FlashAttention-2 kernels, whatever the default picks
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return f.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)

        calls.append(flash)
    return torch.cat(outs), calls


def kernel_times(torch, fn, iters: int = 10) -> dict[str, float]:
    """CUPTI time of each kernel of one call (the split kernel and its merge apart)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {
        e.key: e.device_time_total / iters
        for e in prof.key_averages()
        if e.device_time_total > 0 and "Memcpy" not in e.key
    }


def graph_time(torch, fn, calls: int = 10) -> float | None:
    """Seconds per call of `fn` replayed from a CUDA graph of `calls` calls, as the decode
    step's graph runs it (no host launch gaps); None if the capture fails."""
    import tvm_ffi

    graph = torch.cuda.CUDAGraph()
    try:
        with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
            for _ in range(calls):
                fn()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return None
    return cuda_time(torch, graph.replay, iters=10) / calls


def gated(torch, o, proj):
    """HF's gated attention output: round(o * round(sigmoid(gate))), head h's gate beside its
    query in qkv_proj's row."""
    gate = proj[:, : 2 * HEADS * HEAD_DIM].reshape(-1, HEADS, 2, HEAD_DIM)[:, :, 1]
    return (o.bfloat16().float() * torch.sigmoid(gate.float()).bfloat16().float()).bfloat16()


def ws_rows(kernel: str) -> int:
    """Workspace rows a kernel variant is given: its split budget (the prefill's: unused)."""
    return DECODE_VARIANTS.get(kernel, (0, 128))[1]


def time_case(torch, tvm, attend, x: dict, ref, bw: float, ws_rows: int) -> dict:
    """One kernel on one case: time, error against SDPA's output times the layer's output gate
    (random gates: both kernels apply it where they store o), share of the copy bandwidth."""
    o = torch.empty_like(x["q"])
    # the kernel's split budget; NaN where no piece wrote: a merge that reads such a row shows
    ws = torch.full((ws_rows, HEADS, HEAD_DIM), float("nan"), device="cuda")
    ml = torch.full((ws_rows, HEADS, 2), float("nan"), device="cuda")
    names = ("q", "indptr", "slots", "positions", "table", "kp", "vp")
    args = [tvm.runtime.from_dlpack(x[k]) for k in names] + [0, tvm.runtime.from_dlpack(x["proj"])]
    args += [tvm.runtime.from_dlpack(t) for t in (o, ws, ml)]
    attend(*args)
    torch.cuda.synchronize()

    def error() -> float:
        return (o.float() - gated(torch, ref, x["proj"]).float()).abs().max().item()

    # the first call's error: later calls find the workspaces' rows of the calls before
    # (the same values), so a merge that reads a piece before it is stored passes there
    first_diff = error()
    us = cuda_time(torch, lambda: attend(*args)) * 1e6
    kv_bytes = sum(x["lengths"]) * KV_HEADS * HEAD_DIM * 2 * 2
    kernels = kernel_times(torch, lambda: attend(*args))
    graph_s = graph_time(torch, lambda: attend(*args))
    max_abs_diff = torch.tensor([first_diff, error()]).max().item()  # NaN wins
    graph = (
        {}
        if graph_s is None
        else {"graph_us": graph_s * 1e6, "copy_bw_fraction_graph": kv_bytes / graph_s / bw}
    )
    return {
        **graph,
        "us": us,
        "kernels_us": kernels,
        # inside the decode step's CUDA graph the kernels run back to back: no launch gaps
        "gpu_us": sum(kernels.values()),
        "copy_bw_fraction_gpu": kv_bytes / (sum(kernels.values()) * 1e-6) / bw,
        "max_abs_diff": max_abs_diff,
        "kv_bytes": kv_bytes,
        "copy_bw_fraction": kv_bytes / (us * 1e-6) / bw,
        "tokens": x["q"].shape[0],
    }


def run(out_dir: Path, results: Path | None) -> None:
    import os

    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    import torch
    import tvm

    from qwen35_tvm.runtime.artifact import device_of

    device_of("cuda")
    # every kernel built into DIR (a kernel of another commit may be dropped in beside them)
    kernels = {
        f.name[len("attn_attend_") : -3]: tvm.runtime.load_module(str(f))["main"]
        for f in sorted(out_dir.glob("attn_attend_*.so"))
    }
    bw = copy_bandwidth(torch)
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    rows, warmups = [], {}
    cases = [("decode", name, [L] * B, [1] * B) for name, (B, L) in DECODE.items()]
    cases += [("decode", name, lens, [1] * len(lens)) for name, lens in DECODE_ODD.items()]
    cases += [("prefill", name, lens, lens) for name, lens in PREFILL.items()]
    print(
        "| kind | case | kernel | ours (µs) | in a graph (µs) | kernels only (µs) | SDPA (µs) |"
        " ours / SDPA speed | ours / flash SDPA | % of copy bw (graph; kernels) | max abs Δ |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, name, lengths, queries in cases:
        try:
            x = make_case(torch, lengths, queries)
            ref, calls = sdpa_reference(torch, x)
            sdpa_us = cuda_time(torch, calls[0]) * 1e6 if calls else None
            sdpa_kernels = kernel_times(torch, calls[0]) if calls else {}
            flash_us = cuda_time(torch, calls[1]) * 1e6 if calls else None
        except Exception:
            traceback.print_exc()
            continue
        mine = {tp: f for tp, f in kernels.items() if tp.startswith("mma") == (kind == "prefill")}
        # one kernel timed and discarded first: right after SDPA's runs, the first variant
        # timed ran B1 ~2 us slower than the same kernel timed next (session 20)
        tp0 = next(iter(mine))
        try:
            warmups[name] = time_case(torch, tvm, mine[tp0], x, ref, bw, ws_rows(tp0)).get(
                "graph_us"
            )
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        for tp, attend in mine.items():
            row = {"kind": kind, "case": name, "kernel": tp}
            try:
                row.update(time_case(torch, tvm, attend, x, ref, bw, ws_rows(tp)))
                if sdpa_us is not None:
                    row["sdpa_us"] = sdpa_us
                    row["speed_vs_sdpa"] = sdpa_us / row["us"]
                    row["sdpa_kernels_us"] = sdpa_kernels
                    row["sdpa_flash_us"] = flash_us
                    row["speed_vs_sdpa_flash"] = flash_us / row["us"]
                if kind == "prefill":
                    flops = sum(4 * n * (n + 1) / 2 * HEAD_DIM * HEADS for n in lengths)
                    row["tflops"] = flops / (row["us"] * 1e-6) / 1e12
            except Exception as err:
                traceback.print_exc()
                row["error"] = repr(err)[:500]
            rows.append(row)
            nan = float("nan")
            err = f" ERROR {row['error']}" if "error" in row else ""
            print(
                f"| {kind} | {name} | {tp} | {row.get('us', nan):.1f} | "
                f"{row.get('graph_us', nan):.1f} | "
                f"{row.get('gpu_us', nan):.1f} | {row.get('sdpa_us', nan):.1f} | "
                f"{row.get('speed_vs_sdpa', nan):.2f}x | "
                f"{row.get('speed_vs_sdpa_flash', nan):.2f}x | "
                f"{100 * row.get('copy_bw_fraction', nan):.1f}% "
                f"({100 * row.get('copy_bw_fraction_graph', nan):.1f}%; "
                f"{100 * row.get('copy_bw_fraction_gpu', nan):.1f}%) | "
                f"{row.get('max_abs_diff', '-')} |{err}",
                flush=True,
            )
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bw_tbs": bw / 1e12,
        "rows": rows,
        "discarded_warmup_graph_us": warmups,
    }
    text = json.dumps(result, indent=1)
    (out_dir / "attention_bench_result.json").write_text(text)
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        (results / "attention_kernel.json").write_text(text)
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run"])
    p.add_argument("dir", type=Path)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    build(args.dir, args.arch) if args.step == "build" else run(args.dir, args.out)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
