"""schedules/norm.py's RMSNorm against numpy, in float32 and bfloat16 (the CPU build runs the
GPU kernel's loop nest), at row widths that leave threads idle or give them several columns,
with and without a weight (a decoder layer's norms, whose weight conversion folds into the
next projection), and compiled for CUDA."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm

from qwen35_tvm.schedules.norm import kernel_name, rms_norm

EPS = 1e-6


def run(x: np.ndarray, w: np.ndarray | None, dtype: str, eps: float = EPS) -> np.ndarray:
    """The kernel's output; `w` None: the form without weight."""
    target = tvm.target.Target("llvm")
    dim, weighted = x.shape[1], w is not None
    func = rms_norm(dim, eps, dtype, target, weighted)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    out = tvm.runtime.tensor(np.zeros(x.shape, np_dtype))
    args = [tvm.runtime.tensor(x.astype(np_dtype))] + ([tvm.runtime.tensor(w)] if weighted else [])
    lib[kernel_name(dim, eps, dtype, weighted)](*args, out)
    return out.numpy().astype(np.float32)


def reference(x: np.ndarray, w: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    x = x.astype(np.float64)
    return x / np.sqrt((x**2).mean(axis=1, keepdims=True) + EPS) * w


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 1.6e-2)])
# widths of one vector, of 1-2 lanes, of groups part-filled (300: 10 warps of scalars), of
# 320 lanes (2,560 bf16), and past MAX_THREADS vectors (9,000: 2-3 vectors a lane)
@pytest.mark.parametrize(
    "rows, dim", [(1, 1), (5, 7), (3, 40), (2, 300), (1, 2560), (2, 9000)]
)
def test_matches_numpy(weighted: bool, dtype: str, tol: float, rows: int, dim: int) -> None:
    rng = np.random.default_rng(dim)
    x = (rng.normal(size=(rows, dim)) * 3).astype(np.float32)
    w = rng.normal(size=(dim,)).astype(np.float32)
    ref = reference(x, w if weighted else np.ones(dim, np.float32), dtype)
    got = run(x, w if weighted else None, dtype)
    assert np.abs(got - ref).max() <= tol * max(1.0, np.abs(ref).max())


def test_comparison_notices_a_wrong_mean() -> None:
    # mutation: an eps the size of the mean square moves every output by ~30%
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 40)).astype(np.float32), np.ones(40, np.float32)
    assert np.abs(run(x, w, "float32", eps=1.0) - reference(x, w, "float32")).max() > 0.1


def test_compiles_for_cuda() -> None:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen(["sm_80"])
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    for dim, weighted in ((256, True), (2560, True), (2560, False)):
        func = rms_norm(dim, EPS, "bfloat16", target, weighted)
        lib = tvm.compile(tvm.IRModule({"main": func}), target)
        assert [m.is_runnable() for m in lib.mod.imports if m.kind == "cuda"] == [True]


def test_the_form_without_weight_has_no_weight_parameter() -> None:
    func = rms_norm(64, EPS, "float32", tvm.target.Target("llvm"), weighted=False)
    assert len(func.params) == 2 and kernel_name(64, EPS, "float32", False).startswith("rms_scale")
