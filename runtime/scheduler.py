"""Which sequences run in the next step: FIFO admission against the capacity pool, then every
running decode plus up to `prefill_chunk` prompt tokens (fewer beside decodes, when the caller
sizes the chunk by time: runtime/step_costs.py), oldest admission first."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .kv_pool import CapacityPool
from .sequence import Sequence, Status

# A prompt-logprobs chunk returns one full-vocabulary row per token; this bounds that memory.
PROMPT_LOGPROB_ROWS = 256


@dataclass(frozen=True)
class StepPlan:
    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]  # (sequence, prompt tokens to feed this step)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, pool: CapacityPool, max_batch_size: int, prefill_chunk: int):
        if max_batch_size < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch_size {max_batch_size}, prefill_chunk {prefill_chunk}")
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences to running while pages, slots and batch room last. Strictly
        FIFO: a large request at the head is not overtaken, so it cannot starve."""
        admitted = []
        while self.could_admit():
            seq = self.waiting.popleft()
            seq.slot, seq.page_ids = self.pool.reserve(seq.pages)
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def could_admit(self) -> bool:
        """Whether `admit` would take the next waiting request now."""
        return (
            bool(self.waiting)
            and len(self.running) < self.max_batch_size
            and self.pool.can_reserve(self.waiting[0].pages)
        )

    def plan(self, prefill_budget: Callable[[int, int, int], int] | None = None) -> StepPlan:
        """`prefill_budget(decode rows, prefill_chunk, prompts prefilling)`: the prompt tokens
        this step may take."""
        decode = [s for s in self.running if not s.prefilling]
        budget = self.prefill_chunk
        if prefill_budget is not None:
            prefilling = len(self.running) - len(decode)
            budget = max(1, min(prefill_budget(len(decode), budget, prefilling), budget))
        prefill = []
        for seq in self.running:
            if budget == 0:
                break
            if seq.prefilling:
                n = min(seq.remaining_prompt, budget)
                if seq.return_prompt_logprobs:
                    n = min(n, PROMPT_LOGPROB_ROWS)
                prefill.append((seq, n))
                budget -= n
        return StepPlan(decode, prefill)

    def finish(self, seq: Sequence) -> None:
        """Drop a waiting or running sequence and return its pages and slot at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.pool.release(seq.page_ids, seq.slot)
            seq.slot, seq.page_ids = -1, []
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
