"""Shared by the GPU benchmark scripts: library-only builds here, and timing there."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path


def build_library(
    shape: str,
    dtype: str,
    out: Path,
    arch: str = "sm_80,sm_90",
    cuda_graph: bool = True,
    context_window: int | None = None,
    dependent_launch: bool = True,
) -> float:
    """Compile the library of a real-shape (or tiny) config; weights come later, on the GPU
    server, through `convert`. Returns the compile time in seconds."""
    from qwen35_tvm.compile.build import compile_model
    from qwen35_tvm.compile.random_model import SHAPES

    config_dir = out.parent / f"{out.name}-config"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(SHAPES[shape]))
    started = time.time()
    compile_model(
        config_dir,
        out,
        target="cuda",
        arch=arch,
        dtype=dtype,
        context_window=context_window,
        convert=False,
        cuda_graph=cuda_graph,
        dependent_launch=dependent_launch,
    )
    return time.time() - started


def copy_bandwidth(torch) -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy (best of 20)."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(torch, lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / seconds


def weight_copies(torch, n: int, k: int, gen) -> list:
    """Copies of a random bf16 [n, k] weight that fill the L2 4x: calls cycling through them
    stream their weight from HBM, as in a decode step."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    copies = max(2, -(-4 * l2 // (n * k * 2)))
    return [(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
            for _ in range(copies)]  # fmt: skip


def prefill_random(runner, slots: list[int], pages: int, context: int, rng) -> None:
    """Give slot s pages [s * pages, (s + 1) * pages) and prefill it with a random
    `context`-token prompt (ids uniform in [1000, 100000) from `rng`), a slot at a time: how
    the decode-step benchmarks fill a batch."""
    import numpy as np

    for s in slots:
        runner.add_sequence(s, list(range(s * pages, (s + 1) * pages)))
        tokens = rng.integers(1000, 100000, context).tolist()
        runner.prefill([s], [tokens], np.array([context - 1]))


def cuda_time(torch, fn, iters: int = 20) -> float:
    """Best wall time of `fn` on the GPU, in seconds, by CUDA events."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def write_result(name: str, result: dict, *dirs: Path | None) -> None:
    """`result` as DIR/name in each directory given (None: skipped)."""
    for where in dirs:
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)
            (where / name).write_text(json.dumps(result, indent=1))


def build_or_run(doc: str, build: Callable[[Path], None], run: Callable[[Path, Path | None], None]):
    """The command line of a kernel benchmark: `build DIR` here, `run DIR [--out RESULTS]` on
    the GPU server."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run"])
    p.add_argument("dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="run: also write the JSON here")
    args = p.parse_args()
    if args.step == "build":
        build(args.dir)
    else:
        run(args.dir, args.out)
