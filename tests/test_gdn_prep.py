"""schedules/gdn_prep.py's two kernels against numpy, on the CPU (the GPU kernels' loop nests run
serially), in float32 and bfloat16, and compiled for CUDA.

gdn_input: ragged batches with sequences shorter than the conv window (the state supplies the
history), empty ones, ones spanning several token tiles, a single decode token, non-contiguous
slots of a multi-layer pool; head dims that leave lanes idle and differ between k and v. Its
v must equal today's conv kernel output (gdn.conv1d_with_state) exactly, cast to fp32."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.target import Target

from qwen35_tvm.schedules import gdn
from qwen35_tvm.schedules.gdn_prep import TILE, gated_norm, gdn_input

LLVM = Target("llvm")
N_SLOTS, N_LAYERS, LAYER = 9, 3, 1
EPS = 1e-6
_built: dict[tuple, tvm.runtime.Module] = {}


def _compile(key: tuple, func) -> tvm.runtime.Module:
    if key not in _built:
        _built[key] = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    return _built[key]


def _np(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(_np(dtype)).astype(np.float64)


def input_reference(x, w, a_log, dt_bias, indptr, slots, pool, dims, dtype):
    """(q, k, v, g, beta, pool after) in float64, the inputs as the kernel sees them."""
    hk, hv, dk, dv = dims
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    x, w, pool = (a.astype(np.float64) for a in (x, w, pool))
    hist = w.shape[1] - 1
    conv = np.zeros((x.shape[0], conv_dim))
    for b, slot in enumerate(slots):
        seq = x[indptr[b] : indptr[b + 1], :conv_dim]
        full = np.concatenate([pool[slot, LAYER].T, seq])  # [hist + length, channels]
        for t in range(len(seq)):
            acc = (full[t : t + hist + 1] * w.T).sum(axis=0)
            conv[indptr[b] + t] = acc / (1 + np.exp(-acc))
        pool[slot, LAYER] = full[len(full) - hist :].T
    conv = _round(conv, dtype)

    def l2(a: np.ndarray) -> np.ndarray:
        return a / np.sqrt((a**2).sum(-1, keepdims=True) + 1e-6)

    n = x.shape[0]
    q = l2(conv[:, :key_dim].reshape(n, hk, dk))
    k = l2(conv[:, key_dim : 2 * key_dim].reshape(n, hk, dk))
    v = conv[:, 2 * key_dim :].reshape(n, hv, dv)
    b = x[:, conv_dim + value_dim : conv_dim + value_dim + hv]
    a = x[:, conv_dim + value_dim + hv :] + dt_bias
    g = -np.exp(a_log) * np.logaddexp(0.0, a)
    return q, k, v, g, 1 / (1 + np.exp(-b)), pool


def make_input(lengths, slots, dims, kernel, dtype, seed=0):
    hk, hv, dk, dv = dims
    conv_dim = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    cast = _np(dtype)
    return {
        "x": (rng.normal(size=(n, conv_dim + hv * dv + 2 * hv)) * 2).astype(cast),
        "w": (rng.normal(size=(conv_dim, kernel)) * 0.5).astype(cast),
        "a_log": rng.normal(size=(hv,)).astype(np.float32),
        "dt_bias": rng.normal(size=(hv,)).astype(np.float32),
        "indptr": np.concatenate([[0], np.cumsum(lengths)]).astype("int32"),
        "slots": np.array(slots, "int32"),
        "pool": rng.normal(size=(N_SLOTS, N_LAYERS, conv_dim, kernel - 1)).astype(cast),
    }


def run_input(inp: dict, dims, kernel: int, dtype: str):
    """(q, k, v, g, beta, conv pool after the call)."""
    hk, hv, dk, dv = dims
    lib = _compile(("input", dims, kernel, dtype), gdn_input(hk, hv, dk, dv, kernel, dtype, LLVM))
    n = inp["x"].shape[0]
    names = ("x", "w", "a_log", "dt_bias", "indptr", "slots", "pool")
    args = [tvm.runtime.tensor(inp[name].copy()) for name in names]
    shapes = [(n, hk, dk), (n, hk, dk), (n, hv, dv), (n, hv), (n, hv)]
    outs = [tvm.runtime.tensor(np.full(s, np.nan, np.float32)) for s in shapes]
    lib["gdn_input"](*args, LAYER, *outs)
    return [o.numpy() for o in outs] + [args[-1].numpy()]


def old_conv(inp: dict, dims, kernel: int, dtype: str) -> np.ndarray:
    """Today's conv kernel on the same inputs: its output, cast to fp32."""
    hk, hv, dk, dv = dims
    conv_dim = 2 * hk * dk + hv * dv
    lib = _compile(("conv", conv_dim, kernel, dtype),
                   gdn.conv1d_with_state(conv_dim, kernel, dtype, LLVM))  # fmt: skip
    mixed = np.ascontiguousarray(inp["x"][:, :conv_dim])
    args = [mixed, inp["w"], inp["indptr"], inp["slots"], inp["pool"]]
    tensors = [tvm.runtime.tensor(a.copy()) for a in args]
    out = tvm.runtime.tensor(np.zeros(mixed.shape, _np(dtype)))
    lib["main"](*tensors, LAYER, out)
    return out.numpy().astype(np.float32)


def check_input(lengths, slots, dims, kernel, dtype, seed=0) -> None:
    inp = make_input(lengths, slots, dims, kernel, dtype, seed)
    got = run_input(inp, dims, kernel, dtype)
    ref = input_reference(**inp, dims=dims, dtype=dtype)
    # bf16: the reference's float64 conv may round to the neighbouring bf16 value
    tol = 1e-2 if dtype == "bfloat16" else 1e-5
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got[:5], ref[:5], strict=True):
        assert np.isfinite(a).all(), f"{name}: unwritten or non-finite"
        err = np.abs(a - b).max() / max(1.0, np.abs(b).max())
        assert err <= tol, (name, err)
    np.testing.assert_array_equal(got[-1], inp["pool"])  # read only: gated_norm moves it
    hk, hv, dk, dv = dims
    v_old = old_conv(inp, dims, kernel, dtype)[:, 2 * hk * dk :].reshape(got[2].shape)
    np.testing.assert_array_equal(got[2], v_old)


# (k heads, v heads, k dim, v dim): tiny's, GQA with dk != dv and idle lanes, the 4B head dims
DIMS = [(2, 4, 16, 16), (2, 6, 40, 24), (1, 2, 128, 128)]
# lengths around the window (hist 3) and the tile, an empty sequence, non-contiguous slots
RAGGED = ([2, 0, 1, 3, 4, 2 * TILE + 5, TILE], [5, 1, 7, 0, 2, 8, 4])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", DIMS)
def test_input_ragged_prefill(dims, dtype: str) -> None:
    check_input(*RAGGED, dims, 4, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths, slots", [([1], [3]), ([1, 1, 1, 1, 1], [6, 0, 2, 8, 1])])
def test_input_decode(lengths, slots, dtype: str) -> None:
    check_input(lengths, slots, (2, 6, 40, 24), 4, dtype, seed=1)


@pytest.mark.parametrize("kernel", [2, TILE + 1])
def test_input_other_conv_widths(kernel: int) -> None:
    # a window of 2, and one whose history fills a whole tile
    check_input([1, TILE + 3, 2, 3 * TILE], [0, 4, 8, 2], (2, 4, 16, 16), kernel, "float32")


def test_input_catches_a_wrong_state() -> None:
    # the comparison is sensitive to the state: another slot's history is a failure
    dims, inp = (2, 4, 16, 16), make_input(*RAGGED, (2, 4, 16, 16), 4, "float32")
    got = run_input(inp, dims, 4, "float32")
    bad = input_reference(**{**inp, "slots": inp["slots"][::-1]}, dims=dims, dtype="float32")
    assert np.abs(got[2] - bad[2]).max() > 1e-2


def norm_reference(o, x, w, z_offset, dtype, eps=EPS):
    n, hv, dv = o.shape
    o = _round(o, dtype)
    y = o / np.sqrt((o**2).mean(-1, keepdims=True) + eps) * w
    z = x[:, z_offset : z_offset + hv * dv].astype(np.float64).reshape(n, hv, dv)
    return (_round(y, dtype) * z / (1 + np.exp(-z))).reshape(n, hv * dv)


def run_norm(
    o, x, w, conv: dict, dtype, eps=EPS, o_dtype: str = "float32"
) -> tuple[np.ndarray, np.ndarray]:
    """(gated_norm's output, the conv pool after it); `conv` holds w (its width is the
    kernel's), indptr, slots and pool, as make_input makes them; o given as `o_dtype`."""
    n, hv, dv = o.shape
    conv_dim, kernel = conv["w"].shape
    key = ("norm", hv, dv, conv_dim, kernel, eps, dtype, o_dtype)
    lib = _compile(key, gated_norm(hv, dv, conv_dim, kernel, eps, dtype, LLVM, o_dtype))
    o = o.astype(_np(o_dtype))
    out = tvm.runtime.tensor(np.zeros((n, hv * dv), _np(dtype)))
    pool = tvm.runtime.tensor(conv["pool"].copy())
    args = [tvm.runtime.tensor(a) for a in (o, x, w, conv["indptr"], conv["slots"])]
    lib["gdn_gated_norm"](*args, pool, LAYER, out)
    return out.numpy().astype(np.float32), pool.numpy()


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 1.6e-2)])
@pytest.mark.parametrize("n, hv, dv", [(1, 4, 16), (5, 6, 24), (3, 32, 128), (2, 3, 7)])
def test_gated_norm(n: int, hv: int, dv: int, dtype: str, tol: float) -> None:
    rng = np.random.default_rng(hv * dv)
    dims = (1, hv, dv, dv)  # z sits after q, k and v: at conv_dim = 2 dk + hv dv
    conv = make_input([n], [4], dims, 4, dtype, seed=hv)
    x, conv_dim = conv["x"], conv["w"].shape[0]
    o = (rng.normal(size=(n, hv, dv)) * 3).astype(np.float32)
    w = rng.normal(size=(dv,)).astype(np.float32)
    ref = norm_reference(o, x, w, conv_dim, dtype)
    got, _ = run_norm(o, x, w, conv, dtype)
    assert np.abs(got - ref).max() <= tol * max(1.0, np.abs(ref).max())
    if hv > 1:  # mutation: z of the wrong head is noticed
        x_bad = x.copy()
        zs = slice(conv_dim, conv_dim + hv * dv)
        x_bad[:, zs] = np.roll(x[:, zs], dv, axis=1)
        bad = norm_reference(o, x_bad, w, conv_dim, dtype)
        assert np.abs(got - bad).max() > 0.1


def test_gated_norm_of_o_kept_in_bf16_is_the_same() -> None:
    """o stored in bf16 (gdn_chunked.core_out_dtype) is what gated_norm rounds fp32 o to first,
    so both give the same bits; o rounded otherwise by its producer would not."""
    n, hv, dv = 5, 6, 24
    rng = np.random.default_rng(11)
    conv = make_input([n], [4], (1, hv, dv, dv), 4, "bfloat16", seed=3)
    o = (rng.normal(size=(n, hv, dv)) * 3).astype(np.float32)
    w = rng.normal(size=(dv,)).astype(np.float32)
    ref, _ = run_norm(o, conv["x"], w, conv, "bfloat16")
    got, _ = run_norm(o, conv["x"], w, conv, "bfloat16", o_dtype="bfloat16")
    np.testing.assert_array_equal(got, ref)
    # mutation: a producer that truncates to bf16 instead of rounding to nearest is noticed
    cut = (o.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    bad, _ = run_norm(cut, conv["x"], w, conv, "bfloat16", o_dtype="bfloat16")
    assert not np.array_equal(bad, ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", [4, 2, TILE + 1])
@pytest.mark.parametrize("lengths, slots", [RAGGED, ([1, 1, 1, 1, 1], [6, 0, 2, 8, 1])])
def test_gated_norm_moves_the_conv_state(lengths, slots, kernel: int, dtype: str) -> None:
    """Each sequence's last kernel - 1 inputs (older state where it is shorter) reach its
    slot, an empty sequence's state stays; every other slot and layer is untouched."""
    dims = (2, 6, 40, 24)
    conv = make_input(lengths, slots, dims, kernel, dtype, seed=kernel)
    o = np.ones((len(conv["x"]), 6, 24), np.float32)
    _, pool = run_norm(o, conv["x"], np.ones(24, np.float32), conv, dtype)
    ref = input_reference(**conv, dims=dims, dtype=dtype)[-1].astype(_np(dtype))
    np.testing.assert_array_equal(pool.astype(np.float32), ref.astype(np.float32))  # copies
    # mutation: a state left where it was is noticed
    assert not np.array_equal(conv["pool"].astype(np.float32), ref.astype(np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compile_for_cuda(dtype: str) -> None:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen(["sm_80"])
    cuda = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    for func in (gdn_input(16, 32, 128, 128, 4, dtype, cuda),
                 gated_norm(32, 128, 8192, 4, 1e-6, dtype, cuda),
                 gdn_input(2, 4, 16, 16, 4, dtype, cuda)):  # fmt: skip
        lib = tvm.compile(tvm.IRModule({"main": func}), target=cuda)
        assert [m.is_runnable() for m in lib.mod.imports if m.kind == "cuda"] == [True]
