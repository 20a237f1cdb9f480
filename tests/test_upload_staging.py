"""The page-locked staging that a launched step's inputs cross from (runtime/host_picks.py): the
host must not rewrite values the GPU may not have copied yet, i.e. anything written since the
last step it has waited for. On the CPU the copies are immediate, so this checks the
bookkeeping: what each turn hands out stays intact until that turn comes round again. Also the
other way: a step's logits rows coming to the host one at a time."""

from __future__ import annotations

import numpy as np
import tvm

from qwen35_tvm.runtime.host_picks import StepLogits, UploadStaging


def _values(tensor: tvm.runtime.Tensor) -> list[int]:
    return tensor.numpy().ravel().tolist()


def test_a_turn_keeps_its_values_until_it_comes_round_again():
    staging = UploadStaging(tvm.cpu(), capacity=8)
    a = staging.put(np.arange(5, dtype=np.int32), (5,))
    staging.next_turn()  # a step was launched from `a`; it may still be copying
    b = staging.put(np.full(6, 7, dtype=np.int32), (2, 3))
    c = staging.put(np.full(4, 9, dtype=np.int32), (4,))  # grows this turn's memory
    assert _values(a) == [0, 1, 2, 3, 4]
    assert _values(b) == [7] * 6 and b.shape == (2, 3)
    assert _values(c) == [9] * 4
    staging.next_turn()  # the engine waited for `a`'s step: its turn is free again
    d = staging.put(np.full(5, 3, dtype=np.int32), (5,))
    assert _values(d) == [3] * 5
    assert _values(b) == [7] * 6 and _values(c) == [9] * 4  # the other turn is untouched


def test_settled_staging_starts_both_turns_over():
    staging = UploadStaging(tvm.cpu(), capacity=4)
    staging.put(np.ones(3, dtype=np.int32), (3,))
    staging.next_turn()
    staging.put(np.ones(4, dtype=np.int32), (4,))
    staging.settled()  # a synchronising read: every queued copy is done
    again = staging.put(np.full(4, 5, dtype=np.int32), (4,))
    assert _values(again) == [5] * 4
    assert staging._used == [0, 4]  # written from the start of the turn, not grown


def test_one_logits_row_comes_to_the_host_alone():
    """A sampled row among greedy ones copies that row only, equal to the whole copy's row and
    a copy of its own (the host may mask it in place); rows already on the host are copied
    too."""
    rows = np.random.default_rng(0).normal(size=(5, 257)).astype(np.float32)
    on_device = StepLogits(tvm.runtime.tensor(rows))
    for i in (0, 3, 4):
        got = on_device.row(i)
        np.testing.assert_array_equal(got, rows[i])
        got[:] = 0.0
    assert on_device.on_device  # no whole copy was made
    np.testing.assert_array_equal(on_device.rows(), rows)
    mine = on_device.row(2)
    mine[:] = 0.0
    np.testing.assert_array_equal(on_device.rows()[2], rows[2])
