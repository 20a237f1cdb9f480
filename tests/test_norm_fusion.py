"""Decode's RMSNorm folded into the GEMV it feeds (gemv_kernel's `rms_eps`, and the pass in
compile/norm_fusion.py that uses it). The norm has no weight there: conversion put it in the
projection's columns (tests/test_convert_fold.py).

- The kernel's CPU variant (its loop nest: k-splitting warps, lanes, passes of 8 rows, each
  lane's squares of the X it loads, their sum over warps, 1/rms in the epilogue) against numpy
  at odd shapes, batch 1-33, k below one step and with a tail.
- Mutations: a wrong epsilon, and X rows that disagree with the output rows, fail the check.
- The pass on a small CUDA module: decode's norms are gone, each fused GEMV reading raw x; a
  norm with another reader stays, and so does one with a weight; prefill's norms stay;
  decode_wide's fold too, and not with `FOLD_WIDE` off.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.relax.frontend import nn

from qwen35_tvm.compile import norm_fusion
from qwen35_tvm.compile.layers import Linear, RMSNorm
from qwen35_tvm.compile.pipeline import fusion_passes
from qwen35_tvm.compile.targets import make_target
from qwen35_tvm.schedules import gemv_body
from qwen35_tvm.schedules.gemv import GemvConfig, gemv_kernel
from qwen35_tvm.schedules.gemv_rule import plan

LLVM = tvm.target.Target("llvm")
CUDA, _ = make_target("cuda", "sm_90")
BF16 = ml_dtypes.bfloat16
EPS = 1e-6

# (n, k, batch, config): n off the tile, k below one step (64) or with a tail, uneven warps,
# two passes of 8 rows, decode_wide's buckets
CASES = [
    (40, 24, 1, GemvConfig(m_tiles=1, warps_k=3)),
    (72, 200, 7, GemvConfig(m_tiles=2, warps_k=2, unroll=1)),
    (72, 200, 9, GemvConfig(m_tiles=1, warps_k=3, stages=3)),
    (130, 512, 4, None),
    (72, 200, 33, "wide"),
]


def _run(n: int, k: int, batch: int, cfg, eps: float = EPS, seed: int = 0):
    """(kernel's, numpy's) rmsnorm(x) · wᵀ, x of magnitude ~0.05 so that eps matters."""
    cfg = plan(n, k, "wide") if cfg == "wide" else cfg
    rng = np.random.default_rng(seed + n * k + batch)
    x = (0.05 * rng.standard_normal((batch, k))).astype(BF16)
    w = rng.standard_normal((n, k)).astype(BF16)
    func = gemv_kernel(n, k, LLVM, cfg, rms_eps=eps)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    out = tvm.runtime.tensor(np.zeros((batch, n), np.float32))
    lib["main"](*(tvm.runtime.tensor(a) for a in (x, w)), out)
    xf = x.astype(np.float32)
    inv = 1 / np.sqrt((xf * xf).mean(1, keepdims=True) + EPS)
    return out.numpy(), xf @ w.astype(np.float32).T * inv


def _off(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("n, k, batch, cfg", CASES)
def test_cpu_kernel_matches_numpy(n, k, batch, cfg) -> None:
    got, ref = _run(n, k, batch, cfg)
    assert _off(got, ref) < 1e-5


def test_wrong_epsilon_is_caught() -> None:
    got, ref = _run(40, 200, 7, GemvConfig(warps_k=3), eps=1e-2)
    assert _off(got, ref) > 1e-2


def test_wrong_row_mapping_is_caught(monkeypatch) -> None:
    # the squares follow the loads' maps: a lane summing another row's X misses
    monkeypatch.setattr(gemv_body, "x_row", lambda col, j, g: col + j * 8 + (g + 1) % 8)
    got, ref = _run(40, 200, 8, GemvConfig(warps_k=3))
    assert _off(got, ref) > 1e-3


# ---- the pass ---------------------------------------------------------------------------------


class _Block(nn.Module):
    """A norm feeding a projection, a projection of raw x, and (`shared`) the norm's output
    also returned, so it has a second reader; `weighted`: a norm with a weight of its own."""

    def __init__(self, k: int, n: int, shared: bool, weighted: bool = False):
        self.norm = RMSNorm(k, EPS, weighted)
        self.proj = Linear(k, n, "bfloat16")
        self.other = Linear(k, n, "bfloat16")
        self.shared = shared

    def decode(self, x: nn.Tensor):
        h = self.norm(x)
        y = self.proj(h) + self.other(x)
        return (y, h) if self.shared else y

    prefill = decode_wide = decode


def _lowered(shared: bool, weighted: bool = False) -> tvm.IRModule:
    k, n = 64, 48
    spec = {
        name: {"x": nn.spec.Tensor([rows, k], "bfloat16"), "$": {"param_mode": "plain"}}
        for name, rows in (("decode", "batch"), ("decode_wide", "batch"), ("prefill", "tokens"))
    }
    with CUDA:
        mod, _ = _Block(k, n, shared, weighted).export_tvm(spec=spec)
        return tvm.transform.Sequential(fusion_passes(CUDA))(mod)


def _calls(mod: tvm.IRModule, fn: str) -> list[str]:
    text = mod[fn].script()
    return [line.split("R.call_tir(")[1].split(",")[0] for line in text.splitlines()
            if "R.call_tir(" in line]  # fmt: skip


@pytest.mark.parametrize("shared", [False, True])
def test_decode_norms_fold_into_their_gemv(shared) -> None:
    mod = _lowered(shared)
    decode = _calls(mod, "decode")
    fused = [c for c in decode if c.endswith("_rms_norm")]
    assert len(fused) == 1, decode
    # the fused kernel reads raw x, and no norm weight: every input is [rows, n|k] or [n, k]
    kernel = mod[fused[0]]
    assert kernel.attrs["tirx.is_scheduled"]
    shapes = [p.shape for p in kernel.params]
    assert all(len(shape) == 2 for shape in shapes), shapes
    # the norm stays only where something else reads it
    norms = [c for c in decode if c.startswith("rms_scale")]
    assert len(norms) == int(shared), decode
    prefill = _calls(mod, "prefill")
    assert any(c.startswith("rms_scale") for c in prefill)
    assert not any(c.endswith("_rms_norm") for c in prefill)
    # decode_wide's folds too (FOLD_WIDE)
    wide = _calls(mod, "decode_wide")
    assert len([c for c in wide if c.startswith("rms_scale")]) == int(shared), wide
    assert len([c for c in wide if c.endswith("_rms_norm") and "wide" in c]) == 1, wide


def test_a_norm_with_a_weight_is_not_folded() -> None:
    # the GEMV applies no weight: folding this norm would drop it
    decode = _calls(_lowered(shared=False, weighted=True), "decode")
    assert any(c.startswith("rms_norm") for c in decode), decode
    assert not any(c.endswith("_rms_norm") for c in decode), decode


def test_wide_norms_stay_with_the_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(norm_fusion, "FOLD_WIDE", False)
    wide = _calls(_lowered(shared=False), "decode_wide")
    assert any(c.startswith("rms_scale") for c in wide), wide
    assert not any(c.endswith("_rms_norm") for c in wide), wide
