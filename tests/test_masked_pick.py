"""The bitmask-respecting kernels of schedules/greedy.py against numpy: the masked greedy pick
(argmax and log_softmax of the masked distribution) and the in-place mask, at a decodable width
that is not a multiple of 32, with pad columns holding the largest values (never picked, never
written), a subset of rows, an all-ones mask (= the plain pick), one allowed token and ties."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from plain_pick import pick_of

from qwen35_tvm.schedules.greedy import (
    apply_token_bitmask,
    greedy_pick,
    mask_words,
    workspace_shapes,
)

DECODABLE, SELECTION = 1003, 1024  # 1003 = 31 words + 11 bits; 21 pad columns


def _compile(func) -> tvm.runtime.Module:
    return tvm.compile(tvm.IRModule({"main": func}), tvm.target.Target("llvm"))


def _pack(allowed: np.ndarray) -> np.ndarray:
    """xgrammar's layout: bit j % 32 of word j // 32, little-endian, 1 = allowed."""
    n, width = allowed.shape
    padded = np.zeros((n, mask_words(width) * 32), bool)
    padded[:, :width] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def masked_pick(logits, rows, allowed, decodable=DECODABLE, respect_mask=True, gpu_lanes=False):
    target = tvm.target.Target("llvm")
    lib = _compile(
        greedy_pick(decodable, logits.shape[1], target, masked=True, gpu_lanes=gpu_lanes)
    )
    bits = _pack(allowed) if respect_mask else _pack(np.ones_like(allowed))
    dev = tvm.cpu()
    best = tvm.runtime.empty((len(rows),), "int32", dev)
    logprob = tvm.runtime.empty((len(rows),), "float32", dev)
    args = (logits, np.asarray(rows, np.int32), bits)
    ws = [tvm.runtime.empty(shape, dt, dev) for shape, dt in
          zip(workspace_shapes(len(rows)), ("float32", "int32"), strict=True)]  # fmt: skip
    lib["masked_greedy_pick"](*(tvm.runtime.tensor(a, dev) for a in args), best, logprob, *ws)
    return best.numpy(), logprob.numpy()


def reference(logits, rows, allowed):
    x = np.where(allowed, logits[rows, : allowed.shape[1]].astype(np.float64), -np.inf)
    lsm = x - x.max(axis=1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(axis=1, keepdims=True))
    best = np.argmax(x, axis=1)
    return best, lsm[np.arange(len(rows)), best]


def _case(seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((6, SELECTION)) * 4).astype(np.float32)
    logits[:, DECODABLE:] = 100.0  # a pad column read as a candidate would win every row
    rows = [4, 1, 2]
    allowed = rng.random((3, DECODABLE)) < 0.3
    allowed[1] = False
    allowed[1, DECODABLE - 1] = True  # a single allowed token: the last decodable column
    logits[2, [10, 900]] = 50.0  # a tie between two allowed columns: the lower id wins
    allowed[2, [10, 900]] = True
    logits[4, 7] = 80.0  # the row's max, forbidden
    allowed[0, 7] = False
    return logits, rows, allowed


def test_masked_pick_matches_numpy():
    logits, rows, allowed = _case()
    best, logprob = masked_pick(logits, rows, allowed)
    ref_best, ref_lp = reference(logits, rows, allowed)
    np.testing.assert_array_equal(best, ref_best)
    assert best[1] == DECODABLE - 1 and logprob[1] == pytest.approx(0.0, abs=1e-6)
    assert best[2] == 10 and best[0] != 7
    np.testing.assert_allclose(logprob, ref_lp, atol=1e-5)


def test_the_gpu_lanes_scan_qwen_widths():
    """The GPU's 256 lanes a block (one after another here) over Qwen3.5's vocabulary: a chunk
    of 1,939 columns is 8 a lane, the last partial; the last chunk runs into the pad columns
    (holding the largest values); a tie across two chunks' edge goes to the lower id."""
    rng = np.random.default_rng(3)
    decodable, selection = 248_077, 248_192
    logits = (rng.standard_normal((3, selection)) * 3).astype(np.float32)
    logits[:, decodable:] = 100.0
    allowed = rng.random((3, decodable)) < 0.5
    logits[0, decodable - 1], allowed[0, decodable - 1] = 40.0, True  # in the last chunk
    logits[1, [1938, 1939]], allowed[1, [1938, 1939]] = 30.0, True
    logits[2, 255], allowed[2, 255] = 35.0, True  # a lane's first column
    best, logprob = masked_pick(logits, [0, 1, 2], allowed, decodable, gpu_lanes=True)
    ref_best, ref_lp = reference(logits, [0, 1, 2], allowed)
    np.testing.assert_array_equal(best, [decodable - 1, 1938, 255])
    np.testing.assert_array_equal(best, ref_best)
    np.testing.assert_allclose(logprob, ref_lp, rtol=1e-5, atol=1e-5)


def test_ignoring_the_mask_would_be_caught():
    # The mutation the test above guards: the same kernel with an all-ones mask.
    logits, rows, allowed = _case()
    best, _ = masked_pick(logits, rows, allowed, respect_mask=False)
    assert not np.array_equal(best, reference(logits, rows, allowed)[0])


def test_all_ones_mask_equals_the_plain_pick():
    logits, _, _ = _case(1)
    rows = list(range(logits.shape[0]))
    best, logprob = masked_pick(logits, rows, np.ones((len(rows), DECODABLE), bool))
    plain_best, plain_lp = pick_of(logits, DECODABLE)  # through the logits kernel's triples
    np.testing.assert_array_equal(best, plain_best)
    np.testing.assert_allclose(logprob, plain_lp, rtol=1e-6, atol=1e-6)
    assert (best < DECODABLE).all()


def test_apply_token_bitmask_masks_listed_rows_in_place():
    logits, rows, allowed = _case(2)
    logits[3, DECODABLE:] = -np.inf
    lib = _compile(apply_token_bitmask(DECODABLE, SELECTION, tvm.target.Target("llvm")))
    dev = tvm.cpu()
    buf = tvm.runtime.tensor(logits, dev)
    args = (np.asarray(rows, np.int32), _pack(allowed))
    lib["apply_token_bitmask"](buf, *(tvm.runtime.tensor(a, dev) for a in args))
    out = logits.copy()
    for i, r in enumerate(rows):
        out[r, :DECODABLE][~allowed[i]] = -np.inf  # pad columns untouched (still 100)
    np.testing.assert_array_equal(buf.numpy(), out)


@pytest.mark.parametrize("masked", [True, False])
def test_compiles_for_cuda(masked: bool) -> None:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen(["sm_80"])
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    funcs = {"pick": greedy_pick(248077, 248192, target, masked=masked)}
    if masked:
        funcs["apply"] = apply_token_bitmask(248077, 248192, target)
    lib = tvm.compile(tvm.IRModule(funcs), target)
    assert lib.mod.imports and lib.mod.imports[0].is_runnable()
