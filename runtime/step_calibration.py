"""Seeds a StepCosts (runtime/step_costs.py) with timed throw-away steps when an engine starts.

Without measurements StepCosts cannot size a mixed step, so a fresh server prefills whole
`prefill_chunk` chunks beside its first running decodes: a burst of 16 prompts on a cold
server had each early stream wait through up to 7 steps of ~62 ms (4B, H200; ITL p99 / p50 at
c16 2.8-7.7x in four cold runs against 1.7-1.8x with a level run before it,
docs/performance.md, session 24). Timing a few steps first gives the first burst the chunk
sizes a warm server would pick; real steps replace these samples as they come.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from .step_costs import StepCosts

PREFILL_SIZES = (128, 1024)  # two sizes: the fit's fixed part and its cost a token


class Runner(Protocol):  # what this needs of runtime/model_runner.ModelRunner
    num_slots: int
    page_size: int
    pages_per_seq: int

    def throwaway(self, batch: int, pages: int = 1) -> AbstractContextManager[list[int]]: ...
    def decode(self, slots: list[int], tokens: list[int]) -> object: ...
    def prefill(self, slots: list[int], tokens: list[list[int]], rows: object) -> object: ...


def batch_sizes(largest: int) -> list[int]:
    """1, 2, 4, ... and `largest`: StepCosts borrows a size's nearest measured neighbour."""
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b *= 2
    return [*sizes, largest]


def _timed(step, *args) -> float:
    started = time.perf_counter()
    step(*args)  # the runner's steps return once their picks are on the host
    return time.perf_counter() - started


def calibrate(runner: Runner, costs: StepCosts, largest_batch: int, prefill_chunk: int) -> None:
    """Time a decode at each of `batch_sizes(largest_batch)` and prefills of PREFILL_SIZES
    tokens (at most `prefill_chunk`, within one sequence's pages) on the runner's throw-away
    sequences, and record them in `costs`. Each step runs once untimed first (kernel loading,
    graph capture)."""
    for batch in batch_sizes(min(largest_batch, runner.num_slots)):
        with runner.throwaway(batch) as slots:
            runner.decode(slots, [0] * batch)
            costs.record_decode(batch, _timed(runner.decode, slots, [0] * batch))
    most = min(prefill_chunk, runner.pages_per_seq * runner.page_size // 2)
    for n in sorted({min(size, most) for size in PREFILL_SIZES}):
        pages = -(-2 * n // runner.page_size)  # room for the untimed run and the timed one
        with runner.throwaway(1, pages) as slots:
            tokens, rows = [[0] * n], np.array([n - 1])
            runner.prefill(slots, tokens, rows)
            costs.record_prefill(n, _timed(runner.prefill, slots, tokens, rows))
