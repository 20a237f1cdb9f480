"""The on-device greedy pick: the logits kernel's triples (a chunk of 128 columns each) merged
by the pick kernel equal numpy's argmax and log_softmax over the decodable columns, never pick
a pad column (even one holding the largest value, even from an unmasked build), and break ties
to the lower id; the pick compiles for CUDA too."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from plain_pick import pick, pick_of, project

from qwen35_tvm.schedules.greedy import greedy_pick
from qwen35_tvm.schedules.pick_triples import CHUNK_COLS, pick_chunks

DECODABLE, SELECTION = 1000, 1024
def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("mask_pad", [True, False])
def test_pick_matches_numpy_and_ignores_pad_columns(mask_pad: bool) -> None:
    """Unmasked (the test suite's mutation of the logits kernel), the pad columns hold the
    largest logits, and the triples still leave them out."""
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((5, SELECTION)) * 4).astype(np.float32)
    table[:, DECODABLE:] = 100.0  # a pad column counted by the pick would win every row
    table[1, [3, 700]] = 50.0  # a tie across chunks: the lower id wins
    table[2, DECODABLE - 1] = 60.0  # the last decodable column, in the last chunk
    table[3, [130, 140]] = 70.0  # a tie inside one chunk
    logits, _, _ = project(table, DECODABLE, mask_pad)
    assert np.isneginf(logits[:, DECODABLE:]).all() == mask_pad
    best, logprob = pick_of(table, DECODABLE, mask_pad)
    ref = _log_softmax(table[:, :DECODABLE])
    np.testing.assert_array_equal(best, np.argmax(table[:, :DECODABLE], axis=1))
    assert best[1] == 3 and best[2] == DECODABLE - 1 and best[3] == 130
    np.testing.assert_allclose(logprob, ref[np.arange(5), best], atol=1e-5)


def test_counting_the_pad_columns_would_be_caught() -> None:
    # The mutation the test above guards: triples over every column choose a pad.
    table = np.zeros((1, SELECTION), np.float32)
    table[0, DECODABLE + 5] = 1.0
    best, _ = pick_of(table, SELECTION)
    assert best[0] == DECODABLE + 5
    best, _ = pick_of(table, DECODABLE, mask_pad=False)
    assert best[0] == 0


def _triples(table: np.ndarray, decodable: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy's triples of 128-column chunks over the decodable columns."""
    n, selection = table.shape
    chunks = pick_chunks(selection)
    x = np.full((n, chunks * CHUNK_COLS), -np.inf)
    x[:, :decodable] = table[:, :decodable]
    x = x.reshape(n, chunks, CHUNK_COLS)
    top = x.max(axis=2)
    idx = x.argmax(axis=2) + np.arange(chunks) * CHUNK_COLS
    with np.errstate(invalid="ignore"):
        sums = np.where(np.isneginf(top), 0.0, np.exp(x - top[..., None]).sum(axis=2))
    return np.stack([top, sums], axis=2).astype(np.float32), idx.astype(np.int32)


@pytest.mark.parametrize("decodable", [248_077, 70_001])
def test_the_gpu_lanes_merge_qwen_widths(decodable: int) -> None:
    """The GPU's 256 lanes a block (one after another here) over Qwen3.5's 1,939 chunks: 8
    chunks a lane, the last round partial; also a width whose last chunks have no decodable
    column (their triples -inf, 0)."""
    rng = np.random.default_rng(1)
    selection = 248_192
    table = (rng.standard_normal((3, selection)) * 3).astype(np.float32)
    table[:, decodable:] = 100.0
    table[0, decodable - 1] = 40.0  # the last decodable column
    table[1, [255, 256]] = 30.0  # a tie across two chunks that two lanes merge
    table[2, 1938 * 128 + 5] = 35.0  # the last chunk (the last lane's partial round)
    best, logprob = pick(*_triples(table, decodable), decodable, selection, gpu_lanes=True)
    want = _log_softmax(table[:, :decodable])
    assert best[0] == decodable - 1 and best[1] == 255
    np.testing.assert_array_equal(best, np.argmax(table[:, :decodable], axis=1))
    np.testing.assert_allclose(logprob, want[np.arange(3), best], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["sm_80"])
def test_compiles_for_cuda(arch: str) -> None:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen([arch])
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")
    lib = tvm.compile(tvm.IRModule({"main": greedy_pick(248077, 248192, target)}), target)
    assert lib.mod.imports and lib.mod.imports[0].is_runnable()
