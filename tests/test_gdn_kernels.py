"""The chunked gated delta rule (prefill) against the recurrent one (decode), on the CPU.

Both kernels run on the same ragged batch (lengths around the chunk size, non-zero starting
states in non-contiguous slots of a multi-layer pool); the chunked outputs and the whole
pool afterwards must match the recurrent kernel's. The GPU layout (256 threads, column
tiles) is also run on the CPU, which checks its index arithmetic without a GPU, and the
chunked kernel must compile to SASS for sm_80.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm.target import Target

from qwen35_tvm.compile.cuda_toolchain import fatbin_arches, prepare_cuda_codegen
from qwen35_tvm.schedules import gdn
from qwen35_tvm.schedules.gdn_chunked import chunked_gated_delta_rule

LLVM = Target("llvm")
N_SLOTS, N_LAYERS, LAYER = 9, 3, 1
RTOL = 1e-4  # max |error| over max |reference|, per tensor
_built: dict[tuple, tvm.runtime.Module] = {}


def _compile(key: tuple, func) -> tvm.runtime.Module:
    if key not in _built:
        _built[key] = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    return _built[key]


def recurrent(hk: int, hv: int, dk: int, dv: int) -> tvm.runtime.Module:
    return _compile(("rec", hk, hv, dk, dv), gdn.gated_delta_rule(hk, hv, dk, dv, LLVM))


def chunked(hk: int, hv: int, dk: int, dv: int, chunk: int, **layout: int) -> tvm.runtime.Module:
    key = ("chunked", hk, hv, dk, dv, chunk, tuple(sorted(layout.items())))
    return _compile(key, chunked_gated_delta_rule(hk, hv, dk, dv, LLVM, chunk, **layout))


def make_inputs(
    lengths: list[int], slots: list[int], hk: int, hv: int, dk: int, dv: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Model-like inputs: unit q and k, beta in (0, 1), log decays mostly in [-5, 0) with a
    few very negative ones (a decay of ~e^-30 flushes the state)."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    g = -np.logaddexp(0.0, rng.normal(-1.0, 2.0, (n, hv)))
    g = np.where(rng.random((n, hv)) < 0.02, -30.0, np.maximum(g, -5.0))
    pool = rng.normal(0.0, 0.5, (N_SLOTS, N_LAYERS, hv, dv, dk))
    return {
        "q": unit(rng.normal(size=(n, hk, dk))).astype("float32"),
        "k": unit(rng.normal(size=(n, hk, dk))).astype("float32"),
        "v": rng.normal(size=(n, hv, dv)).astype("float32"),
        "g": g.astype("float32"),
        "beta": (1.0 / (1.0 + np.exp(-rng.normal(0.0, 2.0, (n, hv))))).astype("float32"),
        "indptr": np.concatenate([[0], np.cumsum(lengths)]).astype("int32"),
        "slots": np.array(slots, "int32"),
        "pool": pool.astype("float32"),
    }


def run(lib: tvm.runtime.Module, x: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(outputs, pool after the call); the inputs are left untouched."""
    n, hv, dv = x["v"].shape
    names = ("q", "k", "v", "g", "beta", "indptr", "slots", "pool")
    args = [tvm.runtime.tensor(x[name].copy()) for name in names]
    out = tvm.runtime.tensor(np.full((n, hv, dv), np.nan, "float32"))
    lib["main"](*args, LAYER, out)
    return out.numpy(), args[-1].numpy()


def max_rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def compare(x: dict[str, np.ndarray], rec, chk) -> tuple[float, float]:
    ref_out, ref_pool = run(rec, x)
    out, pool = run(chk, x)
    assert np.isfinite(out).all(), "chunked kernel left outputs unwritten or non-finite"
    assert np.isfinite(ref_out).all()
    err_out, err_pool = max_rel_err(out, ref_out), max_rel_err(pool, ref_pool)
    print(f"max rel error: outputs {err_out:.2e}, states {err_pool:.2e}")
    assert err_out < RTOL and err_pool < RTOL, (err_out, err_pool)
    return err_out, err_pool


LENGTHS, SLOTS = [1, 63, 64, 65, 200], [7, 2, 5, 0, 3]

# (k heads, v heads, k dim, v dim, chunk, layout): the tiny model's GDN shape with the CPU
# layout, then the real 4B head dims (GQA 2) with the GPU layout, run serially on the CPU.
CASES = {
    "tiny-cpu": (2, 4, 16, 16, 64, {}),
    "tiny-cpu-chunk16": (2, 4, 16, 16, 16, {}),
    "4b-dims-gpu-layout": (1, 2, 128, 128, 64, {"threads": 256, "col_tile": 64}),
    "4b-dims-gpu-layout-chunk32": (1, 2, 128, 128, 32, {"threads": 256, "col_tile": 64}),
    "4b-dims-gpu-layout-wide": (1, 2, 128, 128, 64, {"threads": 256, "col_tile": 128}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_recurrent(case: str) -> None:
    hk, hv, dk, dv, chunk, layout = CASES[case]
    x = make_inputs(LENGTHS, SLOTS, hk, hv, dk, dv)
    compare(x, recurrent(hk, hv, dk, dv), chunked(hk, hv, dk, dv, chunk, **layout))


@pytest.mark.parametrize("layout", [{}, {"threads": 64, "col_tile": 8}])
def test_chunk_longer_than_every_sequence(layout: dict[str, int]) -> None:
    # A single partial chunk per sequence, including a zero-length one (state untouched).
    hk, hv, dk, dv = 2, 4, 16, 16
    x = make_inputs([5, 0, 1, 37], [4, 8, 1, 6], hk, hv, dk, dv, seed=1)
    compare(x, recurrent(hk, hv, dk, dv), chunked(hk, hv, dk, dv, 128, **layout))


def test_comparison_catches_a_wrong_state() -> None:
    # The check itself must be sensitive: a perturbed starting state is a failure.
    hk, hv, dk, dv = 2, 4, 16, 16
    x = make_inputs(LENGTHS, SLOTS, hk, hv, dk, dv)
    ref_out, _ = run(recurrent(hk, hv, dk, dv), x)
    x["pool"][SLOTS[-1], LAYER] *= 1.001
    out, _ = run(chunked(hk, hv, dk, dv, 64), x)
    assert max_rel_err(out, ref_out) > RTOL


def test_chunked_compiles_for_cuda(tmp_path: Path) -> None:
    # The 4B shapes with the default GPU layout (150 KiB of shared memory fits sm_80's 163).
    prepare_cuda_codegen(["sm_80"])
    target = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    func = chunked_gated_delta_rule(16, 32, 128, 128, target)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    cuda = [m for m in lib.mod.imports if m.kind == "cuda"]
    assert len(cuda) == 1 and cuda[0].is_runnable(), "CUDA source fallback, not a binary"
    lib.export_library(str(tmp_path / "gdn.so"))
    assert fatbin_arches(tmp_path / "gdn.so") == {"sass": ["sm_80"], "ptx": ["compute_80"]}
    with pytest.raises(ValueError, match="shared memory"):
        chunked_gated_delta_rule(16, 32, 128, 128, target, 64, col_tile=128)


def reference(x: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The delta rule token by token in float64 (state rows = value columns, as pooled)."""
    pool = x["pool"].astype(np.float64)
    n, hv, dv = x["v"].shape
    hk, dk = x["k"].shape[1:]
    out = np.zeros((n, hv, dv))
    for b, slot in enumerate(x["slots"]):
        for t in range(x["indptr"][b], x["indptr"][b + 1]):
            for h in range(hv):
                kh = h // (hv // hk)
                s = pool[slot, LAYER, h] * np.exp(x["g"][t, h])
                delta = (x["v"][t, h] - s @ x["k"][t, kh]) * x["beta"][t, h]
                s += np.outer(delta, x["k"][t, kh])
                pool[slot, LAYER, h] = s
                out[t, h] = s @ x["q"][t, kh] * dk**-0.5
    return out, pool


# (k heads, v heads, k dim, v dim): GQA 2, value columns a multiple of the 32-row tile, fewer
# (16, 8) and an odd k dim (one thread a row, scalar copies).
@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (1, 2, 128, 64), (2, 2, 12, 8), (1, 1, 7, 3)])
def test_recurrent_matches_reference(dims: tuple[int, int, int, int]) -> None:
    hk, hv, dk, dv = dims
    # decode rows (length 1), an empty sequence, and multi-token ones
    x = make_inputs([1, 3, 0, 1, 17], [7, 2, 5, 0, 3], hk, hv, dk, dv, seed=2)
    out, pool = run(recurrent(hk, hv, dk, dv), x)
    ref_out, ref_pool = reference(x)
    assert max_rel_err(out, ref_out) < 1e-5 and max_rel_err(pool, ref_pool) < 1e-5
    # mutation: a state row off by one value column is noticed
    x["pool"][7, LAYER, 0, [0, 1]] = x["pool"][7, LAYER, 0, [1, 0]]
    bad_out, _ = run(recurrent(hk, hv, dk, dv), x)
    if dv > 1:
        assert max_rel_err(bad_out, ref_out) > 1e-3


def test_recurrent_compiles_for_cuda() -> None:
    prepare_cuda_codegen(["sm_80"])
    target = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    lib = tvm.compile(tvm.IRModule({"main": gdn.gated_delta_rule(16, 32, 128, 128, target)}),
                      target=target)  # fmt: skip
    assert [m.is_runnable() for m in lib.mod.imports if m.kind == "cuda"] == [True]


def conv_reference(x, w, indptr, slots, pool):
    """silu of the causal depthwise conv over [old state, tokens] per sequence; new state."""
    hist = w.shape[1] - 1
    out, pool = np.zeros(x.shape), pool.astype(np.float64).copy()
    for b, slot in enumerate(slots):
        seq = x[indptr[b] : indptr[b + 1]].astype(np.float64)
        full = np.concatenate([pool[slot, LAYER].T, seq])  # [hist + length, channels]
        for t in range(len(seq)):
            acc = (full[t : t + hist + 1] * w.T).sum(axis=0)
            out[indptr[b] + t] = acc / (1 + np.exp(-acc))
        pool[slot, LAYER] = full[len(full) - hist :].T
    return out, pool


@pytest.mark.parametrize("target", ["llvm", "cuda"])
def test_conv1d_matches_reference(target: str) -> None:
    channels, kernel = 40, 4
    if target == "cuda":  # no GPU here: the GPU schedule must at least compile
        prepare_cuda_codegen(["sm_80"])
        cuda = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
        tvm.compile(tvm.IRModule({"main": gdn.conv1d_with_state(8192, 4, "bfloat16", cuda)}),
                    target=cuda)  # fmt: skip
        return
    lib = _compile(("conv", channels), gdn.conv1d_with_state(channels, kernel, "float32", LLVM))
    rng = np.random.default_rng(3)
    # lengths around the window (hist = 3): empty, 1, 2, 3, 4 and a longer one
    lengths, slots = [2, 0, 1, 3, 4, 11], [5, 1, 7, 0, 2, 8]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype("int32")
    x = rng.normal(size=(indptr[-1], channels)).astype("float32")
    w = rng.normal(size=(channels, kernel)).astype("float32")
    pool = rng.normal(size=(N_SLOTS, N_LAYERS, channels, kernel - 1)).astype("float32")
    ref_out, ref_pool = conv_reference(x, w, indptr, slots, pool)
    args = [x, w, indptr, np.array(slots, "int32"), pool]
    tensors = [tvm.runtime.tensor(a.copy()) for a in args]
    out = tvm.runtime.tensor(np.zeros_like(x))
    lib["main"](*tensors, LAYER, out)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5)
    np.testing.assert_allclose(tensors[4].numpy(), ref_pool, atol=1e-6)
    # mutation: the reference notices a sequence reading another's state
    bad_out, _ = conv_reference(x, w, indptr, [1, 5, 7, 0, 2, 8], pool)
    assert np.abs(bad_out - out.numpy()).max() > 1e-2


@pytest.mark.parametrize("chunk", [32, 64])
@pytest.mark.parametrize("layout", [{}, {"threads": 256, "col_tile": 32}])
def test_fp32_chunked_edges_match_float64(chunk: int, layout: dict[str, int]) -> None:
    # The fp32 kernel (CPU, and CUDA for fp32 models) at lengths 1, C-1, C, C+1, an empty
    # sequence and a long ragged one, from non-zero states, against the float64 recurrence.
    hk, hv, dk, dv = 1, 2, 128, 64
    lengths = [1, chunk - 1, chunk, chunk + 1, 0, 2 * chunk + 5]
    x = make_inputs(lengths, [7, 2, 5, 0, 3, 8], hk, hv, dk, dv, seed=4)
    out, pool = run(chunked(hk, hv, dk, dv, chunk, **layout), x)
    ref_out, ref_pool = reference(x)
    assert max_rel_err(out, ref_out) < 2e-4 and max_rel_err(pool, ref_pool) < 2e-4
