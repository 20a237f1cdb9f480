"""schedules/activation.py's SwiGLU against numpy, in float32 and bfloat16 (the CPU build runs
the GPU kernel's loop nest), at widths that take 8, 4 or 1 columns a thread and row counts
that leave threads idle; and compiled for CUDA."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm

from qwen35_tvm.schedules.activation import NAME, swiglu


def run(x: np.ndarray, dtype: str) -> np.ndarray:
    target = tvm.target.Target("llvm")
    inter = x.shape[1] // 2
    lib = tvm.compile(tvm.IRModule({"main": swiglu(inter, dtype, target)}), target=target)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    out = tvm.runtime.tensor(np.zeros((x.shape[0], inter), np_dtype))
    lib[f"{NAME}_{dtype}_{inter}"](tvm.runtime.tensor(x.astype(np_dtype)), out)
    return out.numpy().astype(np.float32)


def reference(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    x = x.astype(np.float64)
    gate, up = np.split(x, 2, axis=1)
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("bfloat16", 8e-3)])
@pytest.mark.parametrize("rows, inter", [(1, 1), (3, 7), (1, 8), (5, 20), (2, 96), (3, 264)])
def test_matches_numpy(dtype: str, tol: float, rows: int, inter: int) -> None:
    rng = np.random.default_rng(inter)
    x = (rng.normal(size=(rows, 2 * inter)) * 3).astype(np.float32)
    ref = reference(x, dtype)
    got = run(x, dtype)
    assert np.abs(got - ref).max() <= tol * max(1.0, np.abs(ref).max())


def test_comparison_notices_swapped_halves() -> None:
    # mutation: silu(up) * gate instead of silu(gate) * up
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 40)).astype(np.float32)
    swapped = np.concatenate(np.split(x, 2, axis=1)[::-1], axis=1)
    assert np.abs(run(swapped, "float32") - reference(x, "float32")).max() > 0.1


def test_compiles_for_cuda() -> None:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen(["sm_80", "sm_90"])
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    for inter in (9216, 12):
        lib = tvm.compile(tvm.IRModule({"main": swiglu(inter, "bfloat16", target)}), target)
        assert [m.is_runnable() for m in lib.mod.imports if m.kind == "cuda"] == [True]
