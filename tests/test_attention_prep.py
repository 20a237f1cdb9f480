"""schedules/attention_prep.py's input kernel against numpy, on the CPU (the GPU kernels' loop
nests run serially), in float32 and bfloat16, and compiled for CUDA.

attention_input: ragged batches (an empty sequence, one token, tokens spanning pages), positions
near 30,000 (the fp32 angle, as the model computes it), head dims 16-64 and 256 with idle lanes,
rotary_dim < head_dim and == head_dim, GQA; the K/V pools must equal the reference everywhere,
so a stray write anywhere is caught. Both of its kernels (a block a head, a value a lane, for a
few tokens; up to HEADS_A_BLOCK heads a block, a warp each, otherwise) run every case and must
agree bit for bit, and the host's choice between them is read from the lowered host code."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from tir_host import host_code
from tvm.target import Target

from qwen35_tvm.schedules.attention_prep import (
    FEW_TOKENS,
    HEADS_A_BLOCK,
    INPUT_NAME,
    attention_input,
    inv_freq,
)
from qwen35_tvm.schedules.kv_cache import PAGE_SIZE

LLVM = Target("llvm")
EPS, THETA = 1e-6, 10_000_000.0
N_LAYERS, LAYER, N_SLOTS = 3, 2, 6
_built: dict[tuple, tvm.runtime.Module] = {}


def _compile(key: tuple, func) -> tvm.runtime.Module:
    if key not in _built:
        _built[key] = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    return _built[key]


def _np(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(_np(dtype)).astype(np.float64)


def make_input(lengths, starts, dims, dtype, seed=0) -> dict:
    """A ragged step: sequence b's tokens at positions starts[b].., each in its own slot, every
    page a token touches distinct (others point at one spare page)."""
    heads, kv, d, _ = dims
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    positions = np.concatenate([s + np.arange(m) for s, m in zip(starts, lengths, strict=True)])
    width_pt = max(starts) // PAGE_SIZE + max(lengths) // PAGE_SIZE + 2
    slots = rng.permutation(N_SLOTS)[: len(lengths)].astype("int32")
    spans = list(zip(starts, lengths, strict=True))
    used = sum(len({p // PAGE_SIZE for p in range(s, s + m)}) for s, m in spans)
    n_pages = used + 1
    ids = iter(rng.permutation(used))
    table = np.full((N_SLOTS, width_pt), used, "int32")  # the spare page
    for b, (s, m) in enumerate(spans):
        for page in sorted({p // PAGE_SIZE for p in range(s, s + m)}):
            table[slots[b], page] = next(ids)
    cast = _np(dtype)
    pool = (N_LAYERS, n_pages, kv, PAGE_SIZE, d)
    return {
        "x": (rng.normal(size=(n, (2 * heads + 2 * kv) * d)) * 2).astype(cast),
        "qw": rng.uniform(0.5, 2.0, size=(d,)).astype(np.float32),
        "kw": rng.uniform(0.5, 2.0, size=(d,)).astype(np.float32),
        "freq": inv_freq(dims[3], THETA),
        "indptr": np.concatenate([[0], np.cumsum(lengths)]).astype("int32"),
        "slots": slots,
        "positions": positions.astype("int32"),
        "table": table,
        "kp": rng.normal(size=pool).astype(cast),
        "vp": rng.normal(size=pool).astype(cast),
    }


def input_reference(inp: dict, dims, dtype: str, eps=EPS):
    """(q, k pool, v pool): the model's rounding points, the rest in float64; the angle is the
    fp32 product positions x inv_freq, as the model (and HF) computes it."""
    heads, kv, d, rot = dims
    x = inp["x"].astype(np.float64)
    n, half = x.shape[0], rot // 2
    q = x[:, : 2 * heads * d].reshape(n, heads, 2 * d)[..., :d]
    k = x[:, 2 * heads * d : (2 * heads + kv) * d].reshape(n, kv, d)
    v = inp["x"][:, (2 * heads + kv) * d :].reshape(n, kv, d)
    ang = (inp["positions"].astype(np.float32)[:, None] * inp["freq"]).astype(np.float64)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def norm_rope(a: np.ndarray, w: np.ndarray) -> np.ndarray:
        a = _round(a / np.sqrt((a**2).mean(-1, keepdims=True) + eps) * w, dtype)
        a1, a2, rest = a[..., :half], a[..., half:rot], a[..., rot:]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin, rest], -1)

    kp, vp = inp["kp"].copy(), inp["vp"].copy()
    k = norm_rope(k, inp["kw"])
    for t, pos in enumerate(inp["positions"]):
        b = np.searchsorted(inp["indptr"], t, side="right") - 1
        page = inp["table"][inp["slots"][b], pos // PAGE_SIZE]
        kp[LAYER, page, :, pos % PAGE_SIZE] = k[t]
        vp[LAYER, page, :, pos % PAGE_SIZE] = v[t]
    return norm_rope(q, inp["qw"]), kp, vp


def run_input(inp: dict, dims, dtype: str, eps=EPS, few_tokens: int = FEW_TOKENS):
    heads, kv, d, rot = dims
    func = attention_input(heads, kv, d, rot, eps, dtype, LLVM, few_tokens)
    lib = _compile(("input", dims, eps, dtype, few_tokens), func)
    names = ("x", "qw", "kw", "freq", "indptr", "slots", "positions", "table", "kp", "vp")
    args = [tvm.runtime.tensor(inp[name].copy()) for name in names]
    q = tvm.runtime.tensor(np.full((inp["x"].shape[0], heads, d), np.nan, _np(dtype)))
    lib[INPUT_NAME](*args, LAYER, q)
    return q.numpy(), args[8].numpy(), args[9].numpy()


def check_input(lengths, starts, dims, dtype, seed=0, few_tokens: int = FEW_TOKENS) -> None:
    inp = make_input(lengths, starts, dims, dtype, seed)
    q, kp, vp = run_input(inp, dims, dtype, few_tokens=few_tokens)
    q_ref, kp_ref, vp_ref = input_reference(inp, dims, dtype)
    # bf16: the reference's float64 norm may round to the neighbouring bf16 value
    tol = 1.6e-2 if dtype == "bfloat16" else 2e-6
    for name, a, b in (("q", q, q_ref), ("k pool", kp, kp_ref)):
        a = a.astype(np.float64)
        assert np.isfinite(a).all(), f"{name}: unwritten or non-finite"
        err = np.abs(a - b).max() / max(1.0, np.abs(b).max())
        assert err <= tol, (name, err)
    np.testing.assert_array_equal(vp, vp_ref)  # copies, exact
    untouched = kp_ref == inp["kp"]  # the pages' other rows and other layers are left alone
    np.testing.assert_array_equal(kp[untouched], kp_ref[untouched])


# (heads, kv heads, head dim, rotary dim): tiny's, idle lanes (40 of 64), rotary = head dim,
# the 4B's (two blocks a token), an idle warp (17 heads a token in two blocks of 9 warps)
DIMS = [
    (4, 2, 32, 8), (6, 2, 40, 10), (2, 2, 16, 16), (4, 1, 64, 32), (16, 4, 256, 64),
    (16, 1, 32, 16),
]  # fmt: skip
# an empty sequence, one token, sequences across page boundaries
RAGGED = ([3, 0, 1, 2 * PAGE_SIZE + 5, 7], [0, 4, 9, 30, 13])
# each kernel, whatever the step's size: the many-heads one (0) and the block-a-head one
KERNELS = pytest.mark.parametrize("few_tokens", [0, 1 << 30], ids=["many_heads", "block_a_head"])


@KERNELS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", DIMS)
def test_input_ragged_prefill(dims, dtype: str, few_tokens: int) -> None:
    check_input(*RAGGED, dims, dtype, few_tokens=few_tokens)


@KERNELS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths, starts", [([1], [0]), ([1, 1, 1], [5, 16, 31])])
def test_input_decode(lengths, starts, dtype: str, few_tokens: int) -> None:
    check_input(lengths, starts, (6, 2, 40, 10), dtype, seed=1, few_tokens=few_tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_input_either_side_of_few_tokens(dtype: str) -> None:
    # the default choice, one step of FEW_TOKENS tokens and one of FEW_TOKENS + 1
    for extra in (0, 1):
        check_input([FEW_TOKENS - 4 + extra, 1, 3], [0, 7, 40], (4, 2, 32, 8), dtype, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", DIMS)
def test_kernels_agree_bit_for_bit(dims, dtype: str) -> None:
    # a token's q and k do not depend on how many tokens share its step
    inp = make_input(*RAGGED, dims, dtype, seed=4)
    many = run_input(inp, dims, dtype, few_tokens=0)
    few = run_input(inp, dims, dtype, few_tokens=1 << 30)
    for a, b in zip(many, few, strict=True):
        np.testing.assert_array_equal(a, b)


def test_host_picks_a_block_a_head_for_few_tokens() -> None:
    """At most FEW_TOKENS tokens launch a block a head (256 lanes, 20 blocks a token for the
    4B's 16 + 4 heads); more launch blocks of up to HEADS_A_BLOCK heads (2 of 10 warps)."""
    cuda = Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    host = host_code(attention_input(16, 4, 256, 64, EPS, "bfloat16", cuda), cuda)
    launches = re.findall(r"n_tok \* (\d+), (\d+), launch_params", host)
    assert f"if n_tok <= {FEW_TOKENS}:" in host
    assert launches == [("20", "256"), ("2", "320")] and HEADS_A_BLOCK >= 10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", [(4, 2, 32, 8), (16, 4, 256, 64)])
def test_input_far_positions(dims, dtype: str) -> None:
    # the fp32 angle near 30,000 (its ulp ~2e-3 rad) is what the model computes: matched
    check_input([1, PAGE_SIZE + 3], [30_000, 29_990], dims, dtype, seed=2)


def test_input_catches_swapped_norm_weights_and_a_wrong_rotation() -> None:
    # the comparison is sensitive: k's norm weight for q, or the rotation's sign, is a failure
    dims = (4, 2, 32, 8)
    inp = make_input(*RAGGED, dims, "float32")
    q, _, _ = run_input(inp, dims, "float32")
    swapped, _, _ = input_reference({**inp, "qw": inp["kw"]}, dims, "float32")
    assert np.abs(q - swapped).max() > 0.1
    backwards, _, _ = input_reference({**inp, "freq": -inp["freq"]}, dims, "float32")
    assert np.abs(q - backwards).max() > 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compile_for_cuda(dtype: str) -> None:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen(["sm_80"])
    cuda = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    for func in (attention_input(16, 4, 256, 64, EPS, dtype, cuda),
                 attention_input(6, 2, 40, 10, EPS, dtype, cuda)):  # fmt: skip
        lib = tvm.compile(tvm.IRModule({"main": func}), target=cuda)
        assert [m.is_runnable() for m in lib.mod.imports if m.kind == "cuda"] == [True]
