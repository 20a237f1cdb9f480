"""schedules/embedding.decode_inputs against numpy on the CPU (the GPU loop nest run serially):
each row's embedding gathered by its token id, its slot and position unpacked, indptr 0..batch,
at batches of 1, 5, 64 and 67 (past one block of rows), widths that fill the last block of a row
and widths that do not, bfloat16 and float32; and that it compiles for CUDA."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.target import Target

from qwen35_tvm.schedules.embedding import decode_inputs

LLVM = Target("llvm")
ROWS = 300


def run(step: np.ndarray, table: np.ndarray, dtype: str):
    batch, hidden = len(step), table.shape[1]
    lib = tvm.compile(tvm.IRModule({"main": decode_inputs(hidden, dtype, LLVM)}), target=LLVM)
    outs = [
        tvm.runtime.tensor(np.full((batch, hidden), 7, table.dtype)),
        tvm.runtime.tensor(np.full(batch + 1, -1, np.int32)),
        tvm.runtime.tensor(np.full(batch, -1, np.int32)),
        tvm.runtime.tensor(np.full(batch, -1, np.int32)),
    ]
    lib["decode_inputs"](tvm.runtime.tensor(step), tvm.runtime.tensor(table), *outs)
    return [o.numpy() for o in outs]


def make(batch: int, hidden: int, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    table = rng.normal(size=(ROWS, hidden)).astype(cast)
    step = np.stack(
        [rng.integers(0, ROWS, batch), rng.permutation(100)[:batch], rng.integers(0, 4096, batch)],
        axis=1,
    ).astype(np.int32)
    return step, table


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hidden", [64, 2560, 1028, 36])
@pytest.mark.parametrize("batch", [1, 5, 64, 67])
def test_decode_inputs(batch: int, hidden: int, dtype: str) -> None:
    step, table = make(batch, hidden, dtype, seed=batch + hidden)
    x, indptr, slots, positions = run(step, table, dtype)
    np.testing.assert_array_equal(x.astype(np.float32), table[step[:, 0]].astype(np.float32))
    np.testing.assert_array_equal(indptr, np.arange(batch + 1))
    np.testing.assert_array_equal(slots, step[:, 1])
    np.testing.assert_array_equal(positions, step[:, 2])


def test_rows_follow_their_own_token() -> None:
    # mutation: the rows of a reversed batch are noticed (every id differs from its mirror)
    step, table = make(5, 64, "float32", seed=3)
    step[:, 0] = [1, 2, 3, 4, 5]
    x, *_ = run(step, table, "float32")
    assert not np.array_equal(x, table[step[::-1, 0]])


def test_compiles_for_cuda() -> None:
    from qwen35_tvm.compile.cuda_toolchain import prepare_cuda_codegen

    prepare_cuda_codegen(["sm_80"])
    cuda = Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    lib = tvm.compile(tvm.IRModule({"main": decode_inputs(2560, "bfloat16", cuda)}), target=cuda)
    assert [m.is_runnable() for m in lib.mod.imports if m.kind == "cuda"] == [True]
