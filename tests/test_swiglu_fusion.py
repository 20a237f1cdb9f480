"""Decode's SwiGLU folded into the gate_up GEMV before it (gemv_kernel's `swiglu`).

- The kernel's CPU variant (its loop nest: a block's gate rows and up rows paired per m16
  tile, k-splitting warps, passes of 8 rows, the pair's epilogue) against the two kernels it
  replaces, the GEMV to bf16 then schedules/activation.py's SwiGLU, bit for bit (both sum
  the same rows in the same order), and against numpy to bf16's rounding; at odd widths and
  k, batches 1-7, 9 and decode_wide's 33, with and without the folded RMSNorm.
- Mutations: up read from gate's row (row j, not I + j), and gate and up swapped in the
  epilogue, fail those checks.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from qwen35_tvm.schedules import gemv_store
from qwen35_tvm.schedules.activation import swiglu
from qwen35_tvm.schedules.gemv import GemvConfig, gemv_kernel
from qwen35_tvm.schedules.gemv_rule import plan

LLVM = tvm.target.Target("llvm")
BF16 = ml_dtypes.bfloat16
EPS = 1e-6


def _bf16_gate_up(acc, _row, _col, _extras):
    return T.Cast("bfloat16", acc)  # the gate_up GEMM's epilogue: fp32 sum rounded to bf16


def _call(func: tvm.tirx.PrimFunc, *arrays: np.ndarray) -> np.ndarray:
    """Run `func` on the CPU; the last array is the output."""
    lib = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    args = [tvm.runtime.tensor(a) for a in arrays]
    lib["main"](*args)
    return args[-1].numpy()


def _run(inter: int, k: int, batch: int, cfg, norm: bool) -> tuple[np.ndarray, ...]:
    """(fused kernel's, GEMV + SwiGLU kernels', numpy's) SwiGLU of x · W_gate_upᵀ, bf16, x
    RMSNorm'd first with `norm`. Without the norm, x and W are multiples of 1/8: every sum
    is exact in fp32."""
    cfg = plan(2 * inter, k, "wide") if cfg == "wide" else cfg
    rng = np.random.default_rng(inter * k + batch)
    x = (rng.integers(-8, 9, (batch, k)) / 8).astype(BF16)
    w = (rng.integers(-8, 9, (2 * inter, k)) / 8).astype(BF16)
    nw = (1 + 0.5 * rng.standard_normal(k)).astype(np.float32)
    norm_args = {"extra_shapes": ("k",), "extra_dtypes": ("float32",), "rms_eps": EPS}
    kw = {"out_dtype": "bfloat16", "epilogue": _bf16_gate_up, **(norm_args if norm else {})}
    ins = (x, w, nw) if norm else (x, w)
    fused = _call(gemv_kernel(2 * inter, k, LLVM, cfg, swiglu=True, **kw), *ins,
                  np.zeros((batch, inter), BF16))  # fmt: skip
    gate_up = _call(gemv_kernel(2 * inter, k, LLVM, cfg, **kw), *ins,
                    np.zeros((batch, 2 * inter), BF16))  # fmt: skip
    two = _call(swiglu(inter, "bfloat16", LLVM), gate_up, np.zeros((batch, inter), BF16))
    xf = x.astype(np.float64)
    if norm:  # the CPU keeps X · weight in fp32 (see gemv_body)
        xf = xf * nw / np.sqrt((xf * xf).mean(1, keepdims=True) + EPS)
    gu = (xf @ w.astype(np.float64).T).astype(BF16).astype(np.float64)
    gate, up = gu[:, :inter], gu[:, inter:]
    return fused, two, gate / (1 + np.exp(-gate)) * up


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))


def _off(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


# (inter, k, batch, config): I off the tile (8 columns an m-tile), k below one step (64) or
# with a tail, uneven warps, batch 1-7 and 9 (two passes), decode_wide's buckets
CASES = [
    (20, 24, 1, GemvConfig(m_tiles=1, warps_k=3)),
    (36, 200, 2, GemvConfig(m_tiles=2, warps_k=2, unroll=1)),
    (36, 200, 3, GemvConfig(m_tiles=1, warps_k=3, stages=3)),
    (65, 136, 4, None),
    (20, 24, 5, GemvConfig(m_tiles=2, warps_k=1)),
    (65, 136, 6, GemvConfig(m_tiles=1, warps_k=4)),
    (36, 200, 7, None),
    (36, 200, 9, GemvConfig(m_tiles=2, warps_k=3)),
    (36, 200, 33, "wide"),
]


@pytest.mark.parametrize("inter, k, batch, cfg", CASES)
@pytest.mark.parametrize("norm", [False, True])
def test_cpu_kernel_matches_gemv_then_swiglu(inter, k, batch, cfg, norm) -> None:
    fused, two, ref = _run(inter, k, batch, cfg, norm)
    assert _bits_equal(fused, two)
    assert _off(fused, ref) < 2**-8  # bf16's rounding of the output


@pytest.mark.parametrize(
    "mutation",
    [
        # up read from the gate's row j instead of I + j
        ("paired_row", lambda v: (v // 16 * 8 + v % 8, 0)),
        # the epilogue takes up's sum as gate and gate's as up
        ("pair_rows", lambda c: (c // 8 * 16 + c % 8 + 8, c // 8 * 16 + c % 8)),
    ],
)
def test_wrong_pairing_is_caught(monkeypatch, mutation) -> None:
    monkeypatch.setattr(gemv_store, *mutation)
    fused, two, ref = _run(36, 200, 7, GemvConfig(m_tiles=2, warps_k=3), norm=False)
    assert not _bits_equal(fused, two)
    assert _off(fused, ref) > 0.05


def test_swiglu_needs_an_even_n() -> None:
    with pytest.raises(ValueError, match="even"):
        gemv_kernel(41, 24, LLVM, GemvConfig(), swiglu=True)
