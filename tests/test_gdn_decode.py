"""schedules/gdn_decode.py's fused decode kernel against the two kernels it replaces in a decode
step, gdn_prep.gdn_input then gdn.gated_delta_rule, on the CPU (the GPU loop nest run serially):
one token a sequence, non-contiguous slots of multi-layer pools, float32 and bfloat16, the
tiny model's head dims, GQA with dk != dv, and the 4B head dims."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_gdn_prep import LAYER, N_LAYERS, N_SLOTS, make_input, run_input
from tvm.target import Target

from qwen35_tvm.schedules import gdn
from qwen35_tvm.schedules.gdn_decode import WIDE_LAYOUT, decode_delta_rule

LLVM = Target("llvm")
KERNEL = 4
_built: dict[tuple, tvm.runtime.Module] = {}


def _compile(key: tuple, func) -> tvm.runtime.Module:
    if key not in _built:
        _built[key] = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    return _built[key]


def state_pool(dims, seed: int) -> np.ndarray:
    hk, hv, dk, dv = dims
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 0.5, (N_SLOTS, N_LAYERS, hv, dv, dk)).astype(np.float32)


def two_kernels(inp: dict, rec: np.ndarray, dims, dtype: str, layout: dict | None = None):
    """(o, recurrent pool after) from gdn_input and the ragged recurrent kernel, at the fused
    kernel's block `layout` (gdn_decode.decode_delta_rule's rows, parts): the same sums in the
    same order."""
    hk, hv, dk, dv = dims
    q, k, v, g, beta, _ = run_input(inp, dims, KERNEL, dtype)
    layout = layout or {}
    key = ("rule", dims, tuple(sorted(layout.items())))
    lib = _compile(key, gdn.gated_delta_rule(hk, hv, dk, dv, LLVM, **layout))
    args = [tvm.runtime.tensor(a) for a in (q, k, v, g, beta, inp["indptr"], inp["slots"])]
    pool = tvm.runtime.tensor(rec.copy())
    out = tvm.runtime.tensor(np.full(v.shape, np.nan, np.float32))
    lib["main"](*args, pool, LAYER, out)
    return out.numpy(), pool.numpy()


def fused(inp: dict, rec: np.ndarray, dims, dtype: str, layout: dict | None = None):
    """(o, recurrent pool after, conv pool after) from the fused kernel."""
    hk, hv, dk, dv = dims
    layout = layout or {}
    key = ("fused", dims, dtype, tuple(sorted(layout.items())))
    func = decode_delta_rule(hk, hv, dk, dv, KERNEL, dtype, LLVM, **layout)
    lib = _compile(key, func)
    names = ("x", "w", "a_log", "dt_bias", "slots", "pool")
    args = [tvm.runtime.tensor(inp[name].copy()) for name in names]
    pool = tvm.runtime.tensor(rec.copy())
    out = tvm.runtime.tensor(np.full((len(inp["slots"]), hv, dv), np.nan, np.float32))
    lib[func.attrs["global_symbol"]](*args, pool, LAYER, out)
    return out.numpy(), pool.numpy(), args[-1].numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


DIMS = [(2, 4, 16, 16), (2, 6, 40, 24), (1, 2, 128, 128)]
BATCHES = [[3], [6, 0, 2, 8, 1]]
LAYOUTS = {"decode": {}, "decode_wide": WIDE_LAYOUT}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", BATCHES)
@pytest.mark.parametrize("dims", DIMS)
def test_fused_decode_matches_input_then_rule(dims, slots, dtype: str, layout: str) -> None:
    inp = make_input([1] * len(slots), slots, dims, KERNEL, dtype, seed=len(slots))
    rec = state_pool(dims, seed=7)
    ref_out, ref_pool = two_kernels(inp, rec, dims, dtype, LAYOUTS[layout])
    out, pool, conv = fused(inp, rec, dims, dtype, LAYOUTS[layout])
    assert np.isfinite(out).all(), "outputs unwritten or non-finite"
    assert rel_err(out, ref_out) < 1e-5 and rel_err(pool, ref_pool) < 1e-5  # a readable miss
    # the same arithmetic in the same order: equal, so a decode row and the same token in a
    # prefill chunk start from the same q, k, v and gates
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(pool, ref_pool)
    np.testing.assert_array_equal(conv, inp["pool"])  # read only: gated_norm moves it
    untouched = np.ones(N_SLOTS, bool)
    untouched[slots] = False
    np.testing.assert_array_equal(pool[untouched], rec[untouched])
    np.testing.assert_array_equal(np.delete(pool, LAYER, axis=1), np.delete(rec, LAYER, axis=1))


def test_comparison_catches_a_wrong_history() -> None:
    # mutation: the conv state of another slot changes the outputs past the tolerance
    dims, slots = DIMS[1], BATCHES[1]
    inp = make_input([1] * len(slots), slots, dims, KERNEL, "float32", seed=2)
    rec = state_pool(dims, seed=7)
    ref_out, _ = two_kernels(inp, rec, dims, "float32")
    out, _, _ = fused({**inp, "slots": inp["slots"][::-1].copy()}, rec, dims, "float32")
    assert rel_err(out, ref_out) > 1e-3


def _cuda_source(func, target) -> str:
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    (mod,) = [m for m in lib.mod.imports if m.kind == "cuda"]
    assert mod.is_runnable()
    return mod.inspect_source()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiles_for_cuda_with_a_barrier_a_phase(dtype: str) -> None:
    """At the 4B shapes. A phase that read and wrote the same shared words got a barrier on
    each side of every write from ThreadSync: 65 a token in the recurrent kernel before its
    phases staged their words in registers."""
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen(["sm_80"])
    cuda = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    for layout in LAYOUTS.values():
        fused = _cuda_source(
            decode_delta_rule(16, 32, 128, 128, KERNEL, dtype, cuda, **layout), cuda
        )
        assert fused.count("__syncthreads()") <= 8
    ragged = _cuda_source(gdn.gated_delta_rule(16, 32, 128, 128, cuda), cuda)
    assert ragged.count("__syncthreads()") <= 6
