"""The engine's start-up calibration of StepCosts (runtime/step_calibration.py), on a fake runner
whose steps advance a fake clock: which steps it times, what it records, that it leaves no
sequence behind, and that a calibrated StepCosts sizes a mixed step where a fresh one takes the
whole chunk."""

from __future__ import annotations

import contextlib

import pytest

from qwen35_tvm.runtime import step_calibration
from qwen35_tvm.runtime.step_calibration import PREFILL_SIZES, batch_sizes, calibrate
from qwen35_tvm.runtime.step_costs import StepCosts


def decode_ms(batch: int) -> float:
    return 2.75 + 0.07 * batch  # ~4B on an H200: 2.8 ms at 1 row, 3.9 at 16


# ~4B on an H200: 128 tokens ~6.6 ms, 1,024 ~17 ms
PREFILL_FIXED_MS, PREFILL_TOKEN_MS = 5.1, 0.0116


class FakeRunner:
    def __init__(self, num_slots: int = 32, total_pages: int = 512, pages_per_seq: int = 256):
        self.num_slots, self.total_pages, self.pages_per_seq = num_slots, total_pages, pages_per_seq
        self.page_size = 16
        self.now = 0.0
        self.live: dict[int, list[int]] = {}
        self.decodes: list[int] = []
        self.prefills: list[int] = []

    def clock(self) -> float:
        return self.now

    def add_sequence(self, slot: int, pages: list[int]) -> None:
        assert slot not in self.live and 0 <= slot < self.num_slots
        assert len(pages) <= self.pages_per_seq and all(0 <= p < self.total_pages for p in pages)
        self.live[slot] = pages

    def remove_sequence(self, slot: int) -> None:
        del self.live[slot]

    @contextlib.contextmanager
    def throwaway(self, batch: int, pages: int = 1):
        """ModelRunner.throwaway's contract, over this runner's bookkeeping."""
        slots = list(range(self.num_slots - 1, self.num_slots - 1 - batch, -1))
        for slot in slots:
            self.add_sequence(slot, list(range(self.total_pages - pages, self.total_pages)))
        try:
            yield slots
        finally:
            for slot in slots:
                self.remove_sequence(slot)

    def decode(self, slots: list[int], tokens: list[int]) -> None:
        assert set(slots) <= set(self.live) and len(tokens) == len(slots)
        self.decodes.append(len(slots))
        self.now += decode_ms(len(slots)) / 1e3

    def prefill(self, slots: list[int], tokens: list[list[int]], rows) -> None:
        (slot,), (chunk,) = slots, tokens
        held = len(self.live[slot]) * self.page_size
        assert 2 * len(chunk) <= held, "both runs must fit the sequence's pages"
        assert list(rows) == [len(chunk) - 1]
        self.prefills.append(len(chunk))
        self.now += (PREFILL_FIXED_MS + PREFILL_TOKEN_MS * len(chunk)) / 1e3


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> FakeRunner:
    fake = FakeRunner()
    monkeypatch.setattr(step_calibration.time, "perf_counter", fake.clock)
    return fake


def test_batch_sizes() -> None:
    assert batch_sizes(1) == [1]
    assert batch_sizes(16) == [1, 2, 4, 8, 16]
    assert batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_records_each_size_once_timed_and_leaves_nothing(runner: FakeRunner) -> None:
    costs = StepCosts(0.7, rows_in_prefill=True, tile_rows=128)
    calibrate(runner, costs, largest_batch=20, prefill_chunk=2048)
    # every step twice: an untimed run, then the timed one
    assert runner.decodes == [b for b in batch_sizes(20) for _ in range(2)]
    assert runner.prefills == [n for n in PREFILL_SIZES for _ in range(2)]
    assert not runner.live
    for b in batch_sizes(20):
        assert costs.decode_seconds(b) == pytest.approx(decode_ms(b) / 1e3)
    fixed, per_token = costs.prefill_fit()
    assert fixed == pytest.approx(PREFILL_FIXED_MS / 1e3)
    assert per_token == pytest.approx(PREFILL_TOKEN_MS / 1e3)


def test_a_fresh_server_sizes_its_first_mixed_step(runner: FakeRunner) -> None:
    """Uncalibrated, 16 decodes beside one waiting prompt get the whole 2,048-token chunk;
    calibrated, the step is cut to what the share allows (the floor, in one 128-row tile)."""
    fresh = StepCosts(0.7, rows_in_prefill=True, tile_rows=128)
    assert fresh.prefill_tokens(16, 2048, prefilling=1) == 2048
    calibrate(runner, fresh, largest_batch=16, prefill_chunk=2048)
    assert fresh.prefill_tokens(16, 2048, prefilling=1) == 112


def test_stays_within_the_chunk_and_a_sequence_s_pages(runner: FakeRunner) -> None:
    costs = StepCosts(0.7)
    calibrate(runner, costs, largest_batch=64, prefill_chunk=100)  # 32 slots: 32 at most
    assert max(runner.decodes) == 32
    assert set(runner.prefills) == {100}
    small = FakeRunner(num_slots=4, total_pages=8, pages_per_seq=8)
    step_calibration.time.perf_counter = small.clock  # monkeypatched: undone after the test
    calibrate(small, StepCosts(0.7), largest_batch=4, prefill_chunk=2048)
    assert set(small.prefills) == {64}  # 8 pages of 16 hold both runs of 64 tokens
    assert not small.live


def test_a_real_runner_is_left_as_it_was(tiny_compiled) -> None:
    """On the tiny CPU artifact: calibration's throw-away sequences leave no slot taken, and a
    sequence in the highest slot and pages afterwards (where they ran) gives the logits it
    gives on a fresh runner."""
    import numpy as np
    from test_engine import loaded, prompt

    from qwen35_tvm.runtime.model_runner import ModelRunner

    art, _ = loaded(tiny_compiled)

    def logits(calibrated: bool) -> np.ndarray:
        runner = ModelRunner(art, max_batch_size=4, max_total_tokens=1024, num_slots=4)
        if calibrated:
            calibrate(runner, StepCosts(0.7), largest_batch=4, prefill_chunk=256)
        runner.add_sequence(3, list(range(48, 64)))
        tokens = prompt(37, art.widths.decodable, 3)
        out = runner.prefill([3], [tokens], np.array([36])).rows()
        return np.concatenate([out, runner.decode([3], [5]).rows()])

    np.testing.assert_array_equal(logits(True), logits(False))
