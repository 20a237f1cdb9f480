"""Prefill chunks sized by time beside running decodes (runtime/step_costs.py): the cost fit,
the budget it gives, the scheduler honouring it, and the engine measuring and using it."""

from __future__ import annotations

import numpy as np
import pytest

from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.engine import Engine
from qwen35_tvm.runtime.kv_pool import CapacityPool
from qwen35_tvm.runtime.sampler import SamplingParams
from qwen35_tvm.runtime.scheduler import Scheduler
from qwen35_tvm.runtime.sequence import Sequence
from qwen35_tvm.runtime.step_costs import StepCosts

GREEDY = SamplingParams(temperature=0.0)


def costs_with(decode_s: float, fixed: float, per_token: float, **kw) -> StepCosts:
    costs = StepCosts(**kw)
    costs.record_decode(16, decode_s)
    for n in (64, 256, 1024, 2048):
        costs.record_prefill(n, fixed + per_token * n)
    return costs


def test_fit_recovers_fixed_and_per_token_costs():
    fixed, per_token = costs_with(6e-3, 4e-3, 45e-6).prefill_fit()
    assert fixed == pytest.approx(4e-3) and per_token == pytest.approx(45e-6)


def test_budget_is_what_fits_in_a_decode_step():
    costs = costs_with(6e-3, 2e-3, 50e-6, min_tokens=16)
    assert costs.prefill_tokens(16, 2048) == 80  # (6 - 2) ms / 50 us
    assert costs.prefill_tokens(16, 50) == 50  # never more than the fixed chunk
    assert costs.prefill_tokens(0, 2048) == 2048  # nothing decodes: nothing to stall
    twice = costs_with(6e-3, 2e-3, 50e-6, min_tokens=16, share=2.0)
    assert twice.prefill_tokens(16, 2048) == 200


def test_one_forward_budget_counts_the_decode_rows():
    """A mixed step as one forward may take (1 + share) decode steps, its rows included."""
    costs = costs_with(6e-3, 2e-3, 50e-6, min_tokens=16, rows_in_prefill=True)
    assert costs.prefill_tokens(16, 2048) == 184  # (2 x 6 - 2) ms / 50 us, less the 16 rows
    half = costs_with(6e-3, 2e-3, 50e-6, min_tokens=16, rows_in_prefill=True, share=0.5)
    assert half.prefill_tokens(16, 2048) == 124  # (1.5 x 6 - 2) ms / 50 us - 16


def test_mixed_steps_fill_whole_gemm_tiles():
    """With `tile_rows`, a one-forward mixed step's rows end where a GEMM tile ends."""
    tiled = costs_with(6e-3, 2e-3, 50e-6, min_tokens=16, rows_in_prefill=True, tile_rows=128)
    assert tiled.prefill_tokens(16, 2048) == 112  # time fits 184: 200 rows, down to 128
    assert tiled.prefill_tokens(16, 50) == 50  # the fixed chunk is never exceeded
    assert tiled.prefill_tokens(40, 2048) == 88  # fits 160: 200 rows -> 128
    # down would leave fewer than half: up, into the tile already paid for, unless that tile's
    # measured cost passes the step's limit (here 256 rows took 14.8 ms, over 1.7 x 6)
    assert tiled.prefill_tokens(120, 2048) == 8  # fits 64: 184 rows -> 256 -> 128
    up = StepCosts(min_tokens=16, rows_in_prefill=True, tile_rows=128)
    up.record_decode(16, 6e-3)
    for n in (1024, 2048):  # no tile count at or below two measured: nothing caps
        up.record_prefill(n, 2e-3 + 50e-6 * n)
    assert up.prefill_tokens(120, 2048) == 136
    assert up.prefill_tokens(120, 100) == 100
    floor = costs_with(3e-3, 5e-3, 50e-6, min_tokens=128, rows_in_prefill=True, tile_rows=128)
    assert floor.prefill_tokens(16, 2048) == 112  # the floor's 144 rows -> 128
    assert floor.prefill_tokens(0, 2048) == 2048  # nothing decodes: the whole chunk
    split = costs_with(6e-3, 2e-3, 50e-6, min_tokens=16, tile_rows=128)  # two calls: untiled
    assert split.prefill_tokens(16, 2048) == 80


def test_measured_tile_costs_cap_a_step():
    """Steady mixed steps all take one tile, so the line's slope over them is noise: 5 us a
    token here, which divides the budget into two tiles' worth. The tiles' own costs say no."""
    costs = StepCosts(0.7, 128, rows_in_prefill=True, tile_rows=128)
    costs.record_decode(8, 4.4e-3)
    for _ in range(8):
        costs.record_prefill(120, 6.56e-3)
        costs.record_prefill(128, 6.60e-3)
    fixed, per_token = costs.prefill_fit()
    assert per_token == pytest.approx(5e-6) and fixed > 5.9e-3
    # the line alone: (1.7 x 4.4 - 5.96 - 8 x 0.005) ms / 5 us = 296 tokens -> 256 rows, but two
    # tiles would take ~2 x 6.6 ms (scaled from one), past 1.7 x 4.4: one tile
    assert costs.tile_seconds(2) == pytest.approx(2 * costs.tile_seconds(1))
    assert costs.prefill_tokens(8, 4096) == 120
    # never below half the floor: at 100 decode rows one tile would leave 28 tokens, under 64
    assert costs.prefill_tokens(100, 4096) == 156
    costs.record_prefill(256, 7.0e-3)  # measured within the limit: two tiles may go
    assert costs.prefill_tokens(8, 4096) == 248


def test_a_burst_of_prompts_gets_whole_chunks():
    costs = costs_with(6e-3, 2e-3, 50e-6, min_tokens=16)
    assert costs.prefill_tokens(2, 2048, prefilling=14) == 2048  # prompts outnumber decodes
    assert costs.prefill_tokens(15, 2048, prefilling=1) == 80


def test_floor_keeps_long_prompts_moving():
    costs = costs_with(3e-3, 5e-3, 50e-6, min_tokens=128)  # the fixed part alone is too long
    assert costs.prefill_tokens(16, 2048) == 128


def test_nothing_measured_means_the_fixed_chunk():
    costs = StepCosts()
    assert costs.prefill_tokens(4, 512) == 512
    costs.record_decode(4, 5e-3)
    assert costs.prefill_tokens(4, 512) == 512  # no prefill seen yet
    costs.record_prefill(100, 5e-3)  # one size: a line through the origin
    assert costs.prefill_tokens(4, 512) == 128  # floor (fits exactly 100)
    assert StepCosts(min_tokens=8).prefill_tokens(0, 512) == 512


def test_decode_time_of_the_nearest_batch_size():
    costs = StepCosts()
    costs.record_decode(1, 3e-3)
    costs.record_decode(16, 6e-3)
    assert costs.decode_seconds(2) == 3e-3 and costs.decode_seconds(12) == 6e-3
    costs.record_decode(16, 8e-3)  # an EMA, not the last value
    assert 6e-3 < costs.decode_seconds(16) < 8e-3


def test_scheduler_plans_the_budget_beside_decodes():
    pool = CapacityPool(total_pages=64, num_slots=4)
    sched = Scheduler(pool, max_batch_size=4, prefill_chunk=256)
    running = Sequence(0, list(range(4)), GREEDY, 8, frozenset(), pages=1)
    newcomer = Sequence(1, list(range(300)), GREEDY, 8, frozenset(), pages=20)
    for seq in (running, newcomer):
        sched.add(seq)
    sched.admit()
    running.num_computed = len(running.prompt)  # prefilled: it decodes now
    seen = []

    def budget(rows: int, most: int, prefilling: int) -> int:
        seen.append((rows, most, prefilling))
        return 40

    plan = sched.plan(budget)
    assert seen == [(1, 256, 1)]
    assert plan.decode == [running] and plan.prefill == [(newcomer, 40)]
    assert sched.plan(lambda *_: 10**6).prefill == [(newcomer, 256)]  # capped


def test_engine_times_its_steps_and_sizes_chunks_by_them(tiny_compiled):
    art = Artifact(tiny_compiled.artifact_dir)
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(0, art.widths.decodable, 200).tolist()

    def generate(share):
        engine = Engine(art, max_batch_size=2, max_total_tokens=512, prefill_chunk=64,
                        mixed_step_share=share, mixed_step_min_tokens=8)  # fmt: skip
        a = engine.submit([1, 2, 3], GREEDY, 30, ignore_eos=True)
        engine.step()
        engine.step()  # a decodes now
        if engine.costs is not None:
            # both kinds of step were timed; then, to make the test deterministic, decode
            # steps look 4x as long as a 64-token prefill and nothing more is recorded
            assert engine.costs.decode_seconds(1) > 0 and engine.costs.prefill_fit() is not None
            assert engine.costs.min_tokens == 8
            assert engine.costs.tile_rows == art.meta["prefill_tile_rows"] == 1  # fp32, CPU
            engine.costs = StepCosts(min_tokens=8)
            for n in (16, 64):
                engine.costs.record_prefill(n, n * 1e-3)
            engine.costs.record_decode(1, 16e-3)
            engine.costs.record_decode = engine.costs.record_prefill = lambda *_: None
        b = engine.submit(long_prompt, GREEDY, 4, ignore_eos=True)
        chunks, tokens = [], {a: [], b: []}
        plan = engine.scheduler.plan

        def spy(*args):
            step = plan(*args)
            chunks.extend(n for seq, n in step.prefill if seq.request_id == b)
            return step

        engine.scheduler.plan = spy
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
        return chunks, tokens, engine

    timed_chunks, timed_tokens, engine = generate(1.0)
    fixed_chunks, fixed_tokens, _ = generate(None)
    assert fixed_chunks == [64, 64, 64, 8]
    assert timed_chunks == [16] * 12 + [8], timed_chunks  # 16 ms of prefill beside a decode
    assert timed_tokens == fixed_tokens  # chunking changes the schedule, not the tokens
