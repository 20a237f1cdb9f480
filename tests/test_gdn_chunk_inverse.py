"""The chunk inverse kernel (schedules/gdn_chunk_inverse.py) on the CPU against numpy: for
every chunk of a ragged batch, T = (I + A)⁻¹ of the chunk's decayed, beta-scaled K Kᵀ, stored
by token, with nothing written outside the batch's rows. Run in the CPU's layout and in the
GPU's (256 threads a block), so the GPU's indexing is what is checked."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from test_gdn_kernels import make_inputs
from tvm.target import Target

from qwen35_tvm.schedules.gdn_chunk_inverse import THREADS, gdn_chunk_inverse

LLVM = Target("llvm")


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def reference(x: dict, c: int, decay: bool = True) -> np.ndarray:
    """float64 T rows by token: [n_tok, v_heads, c]."""
    n, hv = x["g"].shape
    hk = x["k"].shape[1]
    out = np.zeros((n, hv, c))
    ptr = x["indptr"]
    for b in range(len(ptr) - 1):
        for t0 in range(ptr[b], ptr[b + 1], c):
            nv = min(c, ptr[b + 1] - t0)
            for h in range(hv):
                k = bf16(x["k"][t0 : t0 + nv, h // (hv // hk)]).astype(np.float64)
                gs = np.cumsum(x["g"][t0 : t0 + nv, h].astype(np.float64))
                dec = np.exp(np.minimum(gs[:, None] - gs[None, :], 0)) if decay else 1.0
                a = np.tril(x["beta"][t0 : t0 + nv, h, None] * dec * (k @ k.T), -1)
                out[t0 : t0 + nv, h, :nv] = np.linalg.inv(np.eye(nv) + a)
    return out


def run(x: dict, c: int, threads: int | None) -> np.ndarray:
    hk, dk = x["k"].shape[1:]
    hv = x["g"].shape[1]
    lib = tvm.compile(
        tvm.IRModule({"main": gdn_chunk_inverse(hk, hv, dk, c, LLVM, threads)}), target=LLVM
    )
    n = x["g"].shape[0]
    tinv = tvm.runtime.tensor(np.full((n, hv, c), np.nan, ml_dtypes.bfloat16))
    args = [tvm.runtime.tensor(x[name]) for name in ("k", "g", "beta", "indptr")]
    lib["main"](*args, tinv)
    return tinv.numpy().astype(np.float32)


@pytest.mark.parametrize("c, threads", [(16, None), (32, THREADS), (64, THREADS)])
def test_every_chunk_gets_its_inverse(c: int, threads: int | None) -> None:
    lengths = [1, c - 1, c, c + 1, 0, 2 * c + 5]
    x = make_inputs(lengths, [0] * len(lengths), 2, 4, 32, 16, seed=3)
    got = run(x, c, threads)
    want = reference(x, c)
    assert not np.isnan(got).any()  # every token's row written, pad columns as zeros
    # each entry within its bf16 rounding (2^-9 relative) and fp32 sums; zeros exact
    assert (np.abs(got - want) <= 4e-3 * np.abs(want) + 1e-5).all()
    # mutation: the same without the decay is far off
    assert np.abs(got - reference(x, c, decay=False)).max() > 0.05


def test_many_sequences_search_their_chunks() -> None:
    # 40 sequences: the binary search over chunk numbers takes several steps
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 50, 40).tolist()
    x = make_inputs(lengths, [0] * 40, 1, 2, 16, 16, seed=8)
    got = run(x, 16, None)
    assert (np.abs(got - reference(x, 16)) <= 4e-3 * np.abs(reference(x, 16)) + 1e-5).all()
