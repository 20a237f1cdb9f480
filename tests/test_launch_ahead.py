"""Steps launched ahead of the host (fp32, CPU): the artifact's `feed_picks` kernel, the
runner's `launch_decode` chain and its `launch_prefill` (a mixed step whose decode rows take
the in-flight step's picks on the device) give exactly the tokens of synchronous stepping. The
engine's overlapped stepping built on them: test_launch_ahead_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_engine import loaded, prompt

from qwen35_tvm.runtime.model_runner import ModelRunner
from qwen35_tvm.schedules.greedy import feed_picks


@pytest.mark.parametrize("batch", [1, 5, 64, 67])
def test_feed_picks_takes_each_pick_one_position_on(batch):
    lib = tvm.compile(feed_picks(tvm.target.Target("llvm")), target="llvm")
    rng = np.random.default_rng(batch)
    step = rng.integers(0, 1000, size=(batch, 3)).astype(np.int32)
    best = rng.integers(0, 1000, size=batch).astype(np.int32)
    out = tvm.runtime.tensor(step)
    lib(out, tvm.runtime.tensor(best))
    want = step.copy()
    want[:, 0], want[:, 2] = best, step[:, 2] + 1
    np.testing.assert_array_equal(out.numpy(), want)


def _prefilled(art, slots, lengths) -> ModelRunner:
    runner = ModelRunner(art, max_batch_size=4, max_total_tokens=1024, num_slots=4)
    for slot, n in zip(slots, lengths, strict=True):
        runner.add_sequence(slot, list(range(slot * 16, slot * 16 + 16)))
        runner.prefill([slot], [prompt(n, art.widths.decodable, slot)], np.array([n - 1]))
    return runner


def test_a_launched_chain_matches_step_by_step_decoding(tiny_compiled):
    art, _ = loaded(tiny_compiled)
    slots, lengths, steps = [2, 0, 3], [9, 1, 30], 6
    sync, ahead = _prefilled(art, slots, lengths), _prefilled(art, slots, lengths)
    tokens, want = [7, 8, 9], []
    for _ in range(steps):
        step = sync.decode(slots, tokens)
        want.append((step.best.copy(), step.best_logprob.copy()))
        tokens = step.best.tolist()
    pending = ahead.launch_decode(slots, [7, 8, 9])
    for k in range(steps):
        nxt = ahead.launch_decode(slots, None) if k + 1 < steps else None
        ids, logprobs = pending.wait()
        np.testing.assert_array_equal(ids, want[k][0])
        np.testing.assert_array_equal(logprobs, want[k][1])
        pending = nxt
    with pytest.raises(ValueError, match="next inputs of slots"):
        ahead.launch_decode([0, 2, 3], None)  # fed in another order
    ahead.remove_sequence(0)
    with pytest.raises(ValueError, match="next inputs of slots"):
        ahead.launch_decode(slots, None)


def test_a_mixed_step_fed_on_the_device_matches_host_tokens(tiny_compiled):
    art, _ = loaded(tiny_compiled)
    slots, lengths = [2, 0, 3], [9, 1, 30]
    sync, ahead = _prefilled(art, slots, lengths), _prefilled(art, slots, lengths)
    chunk = prompt(40, art.widths.decodable, 5)
    for runner in (sync, ahead):
        runner.add_sequence(1, list(range(16, 32)))
    first = sync.decode(slots, [7, 8, 9])
    # the in-flight step's rows are slots 2, 0, 3; the mixed step feeds 3 then 2 (rows 2, 0),
    # leaves slot 0 out and prefills 40 tokens of slot 1
    rows = np.array([0, 1, 41])
    want = sync.prefill([3, 2, 1], [[int(first.best[2])], [int(first.best[0])], chunk], rows)
    ahead.launch_decode(slots, [7, 8, 9]).wait()
    with pytest.raises(ValueError, match="one-token chunks of their own slots"):
        ahead.launch_prefill([2, 3, 1], [[0], [0], chunk], rows, [2, 0])  # other slots' rows
    got = ahead.launch_prefill([3, 2, 1], [[0], [0], chunk], rows, [2, 0])
    ids, logprobs = got.wait()
    np.testing.assert_array_equal(ids, want.best)
    np.testing.assert_allclose(logprobs, want.best_logprob, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="no step in flight"):
        sync.launch_prefill([3], [[0]], np.array([0]), [0])


def test_a_decode_launched_behind_a_prefill_takes_its_picks(tiny_compiled):
    """A mixed step whose rows are one a slot (decode rows, a prompt that ends): the decode
    launched behind it takes each row's pick on the device, one position on, as the host's
    tokens would give; slots in another order than the picks' rows are refused."""
    art, _ = loaded(tiny_compiled)
    slots, lengths = [2, 0], [9, 30]
    sync, ahead = _prefilled(art, slots, lengths), _prefilled(art, slots, lengths)
    chunk = prompt(23, art.widths.decodable, 5)
    for runner in (sync, ahead):
        runner.add_sequence(1, list(range(16, 32)))
    rows, order = np.array([0, 1, 24]), [0, 2, 1]
    mixed = sync.prefill(order, [[7], [8], chunk], rows)
    tokens = mixed.best.tolist()
    want = [sync.decode(order, tokens)]
    want.append(sync.decode(order, want[0].best.tolist()))
    ahead.launch_prefill(order, [[7], [8], chunk], rows, [])
    with pytest.raises(ValueError, match="next inputs of slots"):
        ahead.launch_decode([2, 0, 1], None)
    first = ahead.launch_decode(order, None)
    second = ahead.launch_decode(order, None)  # and the chain goes on from there
    for pending, step in zip((first, second), want, strict=True):
        ids, logprobs = pending.wait()
        np.testing.assert_array_equal(ids, step.best)
        np.testing.assert_allclose(logprobs, step.best_logprob, rtol=0, atol=1e-6)


def test_a_decode_launched_behind_a_decode_takes_the_rows_still_running(tiny_compiled):
    """Rows that ended drop out of the chain: the next decode takes the picks of the rows
    left (a first or middle row gone: a view, or copies of runs of rows), as host tokens
    would give; a removed slot or a row that is another slot's is refused."""
    art, _ = loaded(tiny_compiled)
    slots, lengths = [2, 0, 3, 1], [9, 1, 30, 4]
    sync, ahead = _prefilled(art, slots, lengths), _prefilled(art, slots, lengths)
    first = sync.decode(slots, [7, 8, 9, 10])
    keep = [[2, 0, 1], [0, 1]]  # rows of the step before: slot 3 ends, then slot 2
    want, tokens, held = [], first.best.tolist(), slots
    for rows in keep:
        held = [held[r] for r in rows]
        step = sync.decode(held, [tokens[r] for r in rows])
        want.append(step)
        tokens = step.best.tolist()
    ahead.launch_decode(slots, [7, 8, 9, 10]).wait()
    with pytest.raises(ValueError, match="next inputs of slots"):
        ahead.launch_decode([2, 0, 1], None, [0, 2, 3])  # row 2 is slot 3's
    held = slots
    for rows, step in zip(keep, want, strict=True):
        held = [held[r] for r in rows]
        ids, logprobs = ahead.launch_decode(held, None, rows).wait()
        np.testing.assert_array_equal(ids, step.best)
        np.testing.assert_allclose(logprobs, step.best_logprob, rtol=0, atol=1e-6)
    ahead.remove_sequence(2)
    with pytest.raises(ValueError, match="next inputs of slots"):
        ahead.launch_decode(held, None)
