"""schedules/gdn_decode.py's fused decode kernel against the three kernels it replaces in a
decode step, gdn_prep.gdn_input, gdn.gated_delta_rule and gdn_prep.gated_norm, on the CPU (the
GPU loop nest run serially): one token a sequence, non-contiguous slots of multi-layer pools,
float32 and bfloat16, the tiny model's head dims, GQA with dk != dv, and the 4B head dims. The
GPU's tickets are checked in its source (the CPU runs the blocks' ends as loop nests)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from test_gdn_prep import EPS, LAYER, N_LAYERS, N_SLOTS, make_input, run_input, run_norm
from tvm.target import Target

from qwen35_tvm.schedules import gdn
from qwen35_tvm.schedules.gdn_decode import WIDE_LAYOUT, decode_delta_rule, tickets_shape

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


def norm_weight(dims) -> np.ndarray:
    return np.random.default_rng(5).normal(1.0, 0.3, dims[3]).astype(np.float32)


def three_kernels(inp: dict, rec: np.ndarray, dims, dtype: str, layout: dict | None = None):
    """(o, gated norm's output, recurrent pool after, conv pool after) from gdn_input, the
    ragged recurrent kernel at the fused kernel's block `layout` (gdn_decode.decode_delta_rule's
    rows, parts) and gated_norm: the same sums in the same order."""
    hk, hv, dk, dv = dims
    q, k, v, g, beta, _ = run_input(inp, dims, KERNEL, dtype)
    layout = layout or {}
    key = ("rule", dims, tuple(sorted(layout.items())))
    lib = _compile(key, gdn.gated_delta_rule(hk, hv, dk, dv, LLVM, **layout))
    args = [tvm.runtime.tensor(a) for a in (q, k, v, g, beta, inp["indptr"], inp["slots"])]
    pool = tvm.runtime.tensor(rec.copy())
    out = tvm.runtime.tensor(np.full(v.shape, np.nan, np.float32))
    lib["main"](*args, pool, LAYER, out)
    gated, conv = run_norm(out.numpy(), inp["x"], norm_weight(dims), inp, dtype)
    return out.numpy(), gated, pool.numpy(), conv


def fused(inp: dict, rec: np.ndarray, dims, dtype: str, layout: dict | None = None, eps=EPS):
    """(o, gated norm's output, recurrent pool after, conv pool after, tickets after) from the
    fused kernel."""
    if layout and not layout.get("gated", True):
        return ungated(inp, rec, dims, dtype, layout)
    hk, hv, dk, dv = dims
    layout = layout or {}
    key = ("fused", dims, dtype, eps, tuple(sorted(layout.items())))
    func = decode_delta_rule(hk, hv, dk, dv, KERNEL, eps, dtype, LLVM, **layout)
    lib = _compile(key, func)
    n = len(inp["slots"])
    weights = [tvm.runtime.tensor(inp[name].copy()) for name in ("x", "w", "a_log", "dt_bias")]
    conv = tvm.runtime.tensor(inp["pool"].copy())
    pool = tvm.runtime.tensor(rec.copy())
    tickets = tvm.runtime.tensor(np.zeros(tickets_shape(hk, hv, N_SLOTS), np.int32))
    o = tvm.runtime.tensor(np.full((n, hv, dv), np.nan, np.float32))
    out = tvm.runtime.tensor(np.full((n, hv * dv), np.nan, inp["x"].dtype))
    lib[func.attrs["global_symbol"]](
        *weights, tvm.runtime.tensor(norm_weight(dims)), tvm.runtime.tensor(inp["slots"]), conv,
        pool, tickets, LAYER, o, out,
    )  # fmt: skip
    gated = out.numpy().astype(np.float32)
    return o.numpy(), gated, pool.numpy(), conv.numpy(), tickets.numpy()


def ungated(inp: dict, rec: np.ndarray, dims, dtype: str, layout: dict):
    """fused's tuple from the kernel without the gated norm (gated norm's output None)."""
    hk, hv, dk, dv = dims
    func = decode_delta_rule(hk, hv, dk, dv, KERNEL, EPS, dtype, LLVM, **layout)
    lib = _compile(("ungated", dims, dtype, tuple(sorted(layout.items()))), func)
    names = ("x", "w", "a_log", "dt_bias", "slots", "pool")
    args = [tvm.runtime.tensor(inp[name].copy()) for name in names]
    pool = tvm.runtime.tensor(rec.copy())
    o = tvm.runtime.tensor(np.full((len(inp["slots"]), hv, dv), np.nan, np.float32))
    lib[func.attrs["global_symbol"]](*args, pool, LAYER, o)
    return o.numpy(), None, pool.numpy(), args[-1].numpy(), None


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


DIMS = [(2, 4, 16, 16), (2, 6, 40, 24), (1, 2, 128, 128)]
BATCHES = [[3], [6, 0, 2, 8, 1]]
# decode's kernel, and decode_wide's (without the gated norm; with it at its layout too)
LAYOUTS = {
    "decode": {},
    "decode_wide": {**WIDE_LAYOUT, "gated": False},
    "wide_gated": WIDE_LAYOUT,
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", BATCHES)
@pytest.mark.parametrize("dims", DIMS)
def test_fused_decode_matches_the_three_kernels(dims, slots, dtype: str, layout: str) -> None:
    inp = make_input([1] * len(slots), slots, dims, KERNEL, dtype, seed=len(slots))
    rec = state_pool(dims, seed=7)
    rule_layout = {k: v for k, v in LAYOUTS[layout].items() if k != "gated"}
    ref_o, ref_gated, ref_pool, ref_conv = three_kernels(inp, rec, dims, dtype, rule_layout)
    o, gated, pool, conv, tickets = fused(inp, rec, dims, dtype, LAYOUTS[layout])
    assert np.isfinite(o).all(), "outputs unwritten or non-finite"
    assert rel_err(o, ref_o) < 1e-5 and rel_err(pool, ref_pool) < 1e-5  # a readable miss
    # the same arithmetic in the same order: equal, so a decode row and the same token in a
    # prefill chunk start from the same q, k, v and gates and end with the same norm
    np.testing.assert_array_equal(o, ref_o)
    np.testing.assert_array_equal(pool, ref_pool)
    if gated is None:  # decode_wide's: the conv history is read only (gated_norm moves it)
        np.testing.assert_array_equal(conv, inp["pool"])
    else:
        assert np.isfinite(gated).all() and rel_err(gated, ref_gated) < 1e-5
        np.testing.assert_array_equal(gated, ref_gated)
        np.testing.assert_array_equal(conv.astype(np.float32), ref_conv.astype(np.float32))
        assert not np.array_equal(conv.astype(np.float32), inp["pool"].astype(np.float32))
        assert not tickets.any()  # the CPU takes none; the GPU's last blocks reset theirs
    untouched = np.ones(N_SLOTS, bool)
    untouched[slots] = False
    np.testing.assert_array_equal(pool[untouched], rec[untouched])
    np.testing.assert_array_equal(np.delete(pool, LAYER, axis=1), np.delete(rec, LAYER, axis=1))


def ragged_rule(inp: dict, rec: np.ndarray, dims, dtype: str, o_dtype: str = "float32"):
    """(o as fp32, recurrent pool after) from the ragged kernel (a prefill batch's one-token
    sequences), o NaN where it must not write."""
    hk, hv, dk, dv = dims
    layout = {**WIDE_LAYOUT, "gated": False, "ragged": True, "o_dtype": o_dtype}
    func = decode_delta_rule(hk, hv, dk, dv, KERNEL, EPS, dtype, LLVM, **layout)
    lib = _compile(("ragged", dims, dtype, o_dtype), func)
    names = ("x", "w", "a_log", "dt_bias", "indptr", "slots", "pool")
    args = [tvm.runtime.tensor(inp[name].copy()) for name in names]
    pool = tvm.runtime.tensor(rec.copy())
    o_np = ml_dtypes.bfloat16 if o_dtype == "bfloat16" else np.float32
    o = tvm.runtime.tensor(np.full((inp["x"].shape[0], hv, dv), np.nan, o_np))
    lib[func.attrs["global_symbol"]](*args, pool, LAYER, o)
    np.testing.assert_array_equal(args[-1].numpy(), inp["pool"])  # the conv history: read only
    return o.numpy().astype(np.float32), pool.numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", DIMS[1:])
def test_ragged_kernel_takes_exactly_the_one_token_sequences(dims, dtype: str) -> None:
    # a mixed step: decode rows (one token) around prompt chunks of 2, 3 and 17 tokens
    lengths, slots = [1, 3, 1, 17, 1, 2], [6, 0, 2, 8, 1, 4]
    inp = make_input(lengths, slots, dims, KERNEL, dtype, seed=3)
    rec = state_pool(dims, seed=9)
    ref_o, _, ref_pool, _ = three_kernels(inp, rec, dims, dtype, {"rows": 32, "parts": 4})
    o, pool = ragged_rule(inp, rec, dims, dtype)
    single = [s for s, n in zip(slots, lengths, strict=True) if n == 1]
    rows = inp["indptr"][:-1][np.array(lengths) == 1]
    np.testing.assert_array_equal(o[rows], ref_o[rows])  # the same sums as the decode kernel
    others = np.setdiff1d(np.arange(len(o)), rows)
    assert np.isnan(o[others]).all(), "wrote rows of the chunked rule's sequences"
    np.testing.assert_array_equal(pool[single], ref_pool[single])
    untouched = np.setdiff1d(np.arange(N_SLOTS), single)  # the longer ones' slots too
    np.testing.assert_array_equal(pool[untouched], rec[untouched])


def test_ragged_kernel_keeps_o_in_bf16_rounded_to_nearest() -> None:
    """With o kept in the activation dtype (gdn_chunked.core_out_dtype), each value is the
    fp32 kernel's rounded to nearest even, and the other rows stay unwritten."""
    dims, lengths, slots = DIMS[1], [1, 3, 1, 17, 1, 2], [6, 0, 2, 8, 1, 4]
    inp = make_input(lengths, slots, dims, KERNEL, "bfloat16", seed=3)
    rec = state_pool(dims, seed=9)
    o32, pool32 = ragged_rule(inp, rec, dims, "bfloat16")
    o16, pool16 = ragged_rule(inp, rec, dims, "bfloat16", o_dtype="bfloat16")
    rows = inp["indptr"][:-1][np.array(lengths) == 1]
    want = o32[rows].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(o16[rows], want)
    assert not np.array_equal(want, o32[rows])  # the rounding happened (the check can fail)
    others = np.setdiff1d(np.arange(len(o16)), rows)
    assert np.isnan(o16[others]).all()
    np.testing.assert_array_equal(pool16, pool32)


def test_comparison_catches_a_wrong_history() -> None:
    # mutation: the conv state of another slot changes the outputs past the tolerance
    dims, slots = DIMS[1], BATCHES[1]
    inp = make_input([1] * len(slots), slots, dims, KERNEL, "float32", seed=2)
    rec = state_pool(dims, seed=7)
    ref_o, ref_gated, _, _ = three_kernels(inp, rec, dims, "float32")
    o, gated, _, _, _ = fused({**inp, "slots": inp["slots"][::-1].copy()}, rec, dims, "float32")
    assert rel_err(o, ref_o) > 1e-3 and rel_err(gated, ref_gated) > 1e-3


def test_comparison_catches_a_wrong_norm() -> None:
    # mutation: the gated norm with another epsilon is no longer equal to gated_norm's
    dims, slots = DIMS[0], BATCHES[0]
    inp = make_input([1] * len(slots), slots, dims, KERNEL, "float32", seed=3)
    rec = state_pool(dims, seed=7)
    _, ref_gated, _, _ = three_kernels(inp, rec, dims, "float32")
    _, gated, _, _, _ = fused(inp, rec, dims, "float32", eps=1.0)
    assert rel_err(gated, ref_gated) > 1e-3


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
    for layout in [*LAYOUTS.values(), {**WIDE_LAYOUT, "gated": False, "ragged": True}]:
        fused = _cuda_source(
            decode_delta_rule(16, 32, 128, 128, KERNEL, EPS, dtype, cuda, **layout), cuda
        )
        gated = layout.get("gated", True)
        assert fused.count("__syncthreads()") <= (14 if gated else 8)
        # the blocks' tickets: o published by an acquire-release add; the last block reads o
        # from L2
        assert ("atom.acq_rel.gpu.global.add.s32" in fused) == gated
        assert "atomicAdd(" not in fused and "__threadfence()" not in fused
        assert ("ld.relaxed.gpu.global.f32" in fused) == gated
    ragged = _cuda_source(gdn.gated_delta_rule(16, 32, 128, 128, cuda), cuda)
    assert ragged.count("__syncthreads()") <= 6


ATOMIC_CALL = "tvm_builtin_ptx_atom_acq_rel_gpu_global_add_s32("


def test_the_last_blocks_read_only_o_from_global_memory() -> None:
    """A head's and a k-head's last blocks are the critical path of a decode layer at one
    sequence: after their ticket they read only the other blocks' o from global memory. Each
    block staged its k-head's new q/k history and its head's gate input in shared memory while
    it made its inputs, so the tail reads neither conv nor x; and one acquire-release add a
    ticket, in two threads after a barrier, publishes a block's o, where every thread fenced."""
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen(["sm_80"])
    cuda = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    source = _cuda_source(decode_delta_rule(16, 32, 128, 128, KERNEL, EPS, "bfloat16", cuda), cuda)
    body = source[source.index('extern "C" __global__') :]
    atomic = body.index(ATOMIC_CALL)
    assert body.count(ATOMIC_CALL) == 1 and "thread_fence" not in body
    opened = body.rfind("if (((int)threadIdx.x) < 2) {", 0, atomic)
    assert body.rfind("__syncthreads();", 0, atomic) < opened
    tail = body[atomic:]
    reads = [s.split(" = ", 1)[1] for s in tail.split(";") if " = " in s]
    assert not [r for r in reads if "conv_ptr[" in r or "x_ptr[" in r]
    assert any("o_ws_ptr[" in s for s in tail.split(";") if "ld_relaxed" in s)
