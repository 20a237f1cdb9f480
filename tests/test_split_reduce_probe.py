"""benchmarks/split_reduce_probe.py: the cubin exports the kernels the probe launches, its
constants and partials are the CUDA source's, and its reference sums the splits in order.
Needs nvcc, no GPU."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from benchmark_module import load

probe = load("split_reduce_probe")


def test_cubin_holds_the_kernels_the_probe_launches(tmp_path: Path) -> None:
    probe.build(tmp_path)
    cubin = (tmp_path / probe.CUBIN).read_bytes()
    entries = set(re.findall(rb"\.text\.(\w+)\x00", cubin))
    assert {b"ws_store", b"ws_reduce", b"dsmem_reduce"} <= entries


def test_constants_and_partials_are_the_sources() -> None:
    src = probe.SOURCE.read_text()
    consts = dict(re.findall(r"constexpr int (\w+) = (\d+);", src))
    assert {k: int(consts[k]) for k in ("M", "TILE_N", "SPLITS", "THREADS")} == {
        "M": probe.M, "TILE_N": probe.TILE_N, "SPLITS": probe.SPLITS, "THREADS": probe.THREADS
    }  # fmt: skip
    want = (f"((split * {probe.A} + row * {probe.B} + col * {probe.C}) % {probe.D}) * "
            f"{probe.SCALE}f - {probe.SHIFT}f")  # fmt: skip
    assert want in src
    assert probe.PARTIAL_BYTES == probe.M * probe.TILE_N * 4 <= probe.GEMM_SHARED


def test_reference_sums_every_split() -> None:
    n = 2 * probe.TILE_N
    res = torch.zeros(probe.M, n, dtype=torch.bfloat16)
    got = probe.reference(torch, res, n)
    row, col = 5, probe.TILE_N + 3  # the second tile's column 3
    parts = [((s * probe.A + row * probe.B + 3 * probe.C) % probe.D) * probe.SCALE - probe.SHIFT
             for s in range(probe.SPLITS)]  # fmt: skip
    assert got[row, col].item() == torch.tensor(sum(parts)).to(torch.bfloat16).item()
    assert torch.equal(got[:, :3], got[:, probe.TILE_N : probe.TILE_N + 3])  # per tile
