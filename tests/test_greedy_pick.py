"""The on-device greedy pick equals numpy's argmax and log_softmax over the decodable columns,
never picks a pad column (even one holding the largest value), and breaks ties to the lower id;
it compiles for CUDA too."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from qwen35_tvm.schedules.greedy import greedy_pick, workspace_shapes

DECODABLE, SELECTION = 1000, 1024


def _run_cpu(
    logits: np.ndarray, decodable: int, gpu_lanes: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    target = tvm.target.Target("llvm")
    pick = greedy_pick(decodable, logits.shape[1], target, gpu_lanes=gpu_lanes)
    lib = tvm.compile(tvm.IRModule({"main": pick}))
    dev = tvm.cpu()
    best = tvm.runtime.empty((logits.shape[0],), "int32", dev)
    logprob = tvm.runtime.empty((logits.shape[0],), "float32", dev)
    ws = [tvm.runtime.empty(shape, dt, dev) for shape, dt in
          zip(workspace_shapes(logits.shape[0]), ("float32", "int32"), strict=True)]  # fmt: skip
    lib["greedy_pick"](tvm.runtime.tensor(logits, dev), best, logprob, *ws)
    return best.numpy(), logprob.numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def test_pick_matches_numpy_and_ignores_pad_columns() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, SELECTION)) * 4).astype(np.float32)
    logits[:, DECODABLE:] = 100.0  # an unmasked pad column would win every row
    logits[1, [3, 700]] = 50.0  # a tie: the lower id wins
    logits[2, DECODABLE - 1] = 60.0  # the last decodable column
    best, logprob = _run_cpu(logits, DECODABLE)
    ref = _log_softmax(logits[:, :DECODABLE])
    np.testing.assert_array_equal(best, np.argmax(logits[:, :DECODABLE], axis=1))
    assert best[1] == 3 and best[2] == DECODABLE - 1
    np.testing.assert_allclose(logprob, ref[np.arange(5), best], atol=1e-5)


def test_reading_the_whole_arena_would_be_caught() -> None:
    # The mutation the test above guards: a pick over all columns chooses a pad.
    logits = np.zeros((1, SELECTION), np.float32)
    logits[0, DECODABLE + 5] = 1.0
    best, _ = _run_cpu(logits, SELECTION)
    assert best[0] == DECODABLE + 5
    best, _ = _run_cpu(logits, DECODABLE)
    assert best[0] == 0


@pytest.mark.parametrize("arch", ["sm_80"])
def test_compiles_for_cuda(arch: str) -> None:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen([arch])
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")
    lib = tvm.compile(tvm.IRModule({"main": greedy_pick(248077, 248192, target)}), target)
    source = lib.mod.imports[0].inspect_source("cu") if lib.mod.imports else ""
    assert lib.mod.imports and lib.mod.imports[0].is_runnable()
    del source


@pytest.mark.parametrize("decodable", [248_077, 70_001])
def test_pick_with_the_gpu_lanes_matches_numpy(decodable: int) -> None:
    """The GPU's 256 lanes a block (run one after another here) over Qwen3.5's vocabulary: a
    chunk of 1,939 columns is 8 columns a lane, the last one partial, and the last chunk runs
    past the decodable width into the pad columns (one holding the largest value); also a
    width whose chunks end mid-lane. Every lane loads its columns before it compares them."""
    rng = np.random.default_rng(1)
    selection = -(-decodable // 128) * 128
    logits = (rng.standard_normal((3, selection)) * 3).astype(np.float32)
    logits[:, decodable:] = 100.0
    logits[0, decodable - 1] = 40.0  # the last decodable column, in the last chunk
    logits[1, [1938, 1939]] = 30.0  # a tie across two chunks' edge: the lower id
    logits[2, 255] = 35.0  # a lane's first column
    best, logprob = _run_cpu(logits, decodable, gpu_lanes=True)
    want = _log_softmax(logits[:, :decodable])
    np.testing.assert_array_equal(best, [decodable - 1, 1938, 255])
    np.testing.assert_allclose(logprob, want[np.arange(3), best], rtol=1e-5, atol=1e-5)
