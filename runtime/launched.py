"""Steps launched ahead of the host (the engine's `LaunchAhead`): what a step's forward reads
back (the rows it makes logits for), what a step in flight carries, whether a step's sequences
need nothing from the host but the device's greedy picks, and which step goes behind the one in
flight: a decode of its rows still running, or a mixed step whose decode rows it feeds."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .host_picks import PendingPicks
from .scheduler import Scheduler, StepPlan
from .sequence import Output, Sequence, Status
from .step_sampling import Picked, StepSampler

if TYPE_CHECKING:
    from .model_runner import ModelRunner
    from .step_costs import StepCosts


@dataclass(frozen=True)
class StepInfo:
    """What the last `step()` call completed: a "decode", "mixed" (decode rows and prompt
    tokens) or "prefill" step, with its decode rows and prompt tokens."""

    kind: str
    decode_rows: int
    prompt_tokens: int


def logits_rows(chunks: list[tuple[Sequence, int]]) -> tuple[np.ndarray, list[int]]:
    """The rows a forward over `chunks` makes logits for (indices into the concatenated tokens),
    and how many each chunk has: every position of a prompt chunk that asks for prompt
    logprobs, the last token of a chunk sampled now (a decode row, or the end of a prompt), none
    for the middle of a prompt: a mixed step of 16 decode rows stays in the logits kernel's
    16-row bucket. A forward makes at least one row (its last token's, not read)."""
    positions: list[int] = []
    counts, offset = [], 0
    for seq, n in chunks:
        if seq.prefilling and seq.return_prompt_logprobs:
            rows = list(range(offset, offset + n))
        elif not seq.prefilling or n == seq.remaining_prompt:
            rows = [offset + n - 1]
        else:
            rows = []
        positions += rows
        counts.append(len(rows))
        offset += n
    return np.asarray(positions or [offset - 1], dtype=np.int32), counts


@dataclass
class InFlight:
    """A step launched ahead and not read yet: the sequence each picks row samples, the
    picks, and what the step is."""

    rows: list[Sequence]
    picks: PendingPicks
    info: StepInfo


def ends_by_length(seq: Sequence, unread: int) -> bool:
    """Whether `seq` has its last token once `unread` tokens not yet read arrive."""
    return len(seq.output) + unread >= seq.max_tokens


def picks_suffice(seqs: list[Sequence], picker: StepSampler, unread: int) -> bool:
    """Whether each of `seqs` takes the device's greedy pick as its next token (no grammar, no
    alternatives, greedy) and may still have one after `unread` tokens not yet read."""
    return all(
        s.status is Status.RUNNING
        and s.grammar is None
        and picker.wants_pick(s)
        and not ends_by_length(s, unread)
        for s in seqs
    )


class LaunchAhead:
    """The engine's steps launched ahead of the host (mixed into runtime/engine.Engine, whose
    state these attributes are): `step()` launches where `_may_launch_ahead` or
    `_may_mix_ahead` allow, and while a step is in flight the next `step()` launches the one
    behind it before reading it (`_step_ahead`)."""

    runner: ModelRunner
    scheduler: Scheduler
    picker: StepSampler
    costs: StepCosts | None
    overlap: bool
    one_forward: bool
    last_step: StepInfo | None
    _ahead: InFlight | None
    _chained_at: float | None  # when a step chained behind another ended

    def _emit(self, picked: list[Picked]) -> list[Output]:  # the engine's: report tokens
        raise NotImplementedError

    def _start(self, seq: Sequence) -> None:  # the engine's: a sequence takes its slot
        raise NotImplementedError

    def _may_launch_ahead(self, seqs: list[Sequence], unread: int) -> bool:
        """Whether a decode of `seqs` may be launched ahead, `unread` tokens each still to come
        from the step in flight: only steady greedy decoding, where the token is the device's
        pick, with no request waiting that could join, every running sequence in `seqs` but
        those sure to have stopped by length at those tokens, and none of `seqs` so."""
        chosen = {id(s) for s in seqs}
        return (
            self.overlap
            and bool(seqs)
            and not self.scheduler.could_admit()
            and picks_suffice(seqs, self.picker, unread)
            and all(id(s) in chosen or ends_by_length(s, unread) for s in self.scheduler.running)
        )

    def _step_ahead(self) -> list[Output]:
        """Launch the next step behind the one in flight where it can be fed on the device (a
        decode of its rows still running, `_may_launch_ahead`; a mixed step, `_mix_behind`),
        then read the one in flight and report its tokens. A row that stops now was already fed
        forward: its next token is computed and dropped (within its pages: they hold
        max_tokens)."""
        done, self._ahead = self._ahead, None
        self.last_step = done.info
        # a decode behind a decode or behind the mixed step where the last prompts end: every
        # running sequence is a row of `done`, which feeds it on the device; rows that ended
        # before it, or end by length in it, drop out
        live = [i for i, s in enumerate(done.rows) if s.status is Status.RUNNING]
        going = [i for i in live if not ends_by_length(done.rows[i], 1)]
        if self._may_launch_ahead([done.rows[i] for i in going], 1):
            self._launch([done.rows[i] for i in going], None, going)
        else:
            self._mix_behind(done)
        tokens, logprobs = done.picks.wait()
        now = time.perf_counter()
        if self.costs is not None and self._chained_at is not None:  # a step's GPU time
            if done.info.kind == "decode":
                self.costs.record_decode(done.info.decode_rows, now - self._chained_at)
            else:
                tokens_in = done.info.decode_rows + done.info.prompt_tokens
                self.costs.record_prefill(tokens_in, now - self._chained_at)
        self._chained_at = now if self._ahead is not None else None
        return self._emit([(done.rows[i], int(tokens[i]), float(logprobs[i]), None) for i in live])

    def _launch(
        self, seqs: list[Sequence], tokens: list[int] | None, rows: list[int] | None = None
    ) -> None:
        """Launch a decode of `seqs`: with `tokens`, or (None) fed rows `rows` of the picks of
        the step in flight."""
        picks = self.runner.launch_decode([s.slot for s in seqs], tokens, rows)
        self._ahead = InFlight(list(seqs), picks, StepInfo("decode", len(seqs), 0))
        for seq in seqs:
            seq.num_computed += 1

    def _mix_behind(self, done: InFlight) -> None:
        """Admit, plan, and launch a step of prompt chunks behind `done` (in flight) where every
        row's token is the device's pick: the decode rows' come from `done`'s picks, copied on
        the device, and a prompt that ends here takes its first token the same way. Otherwise
        nothing is launched, and the next `step()` runs synchronously."""
        row_of = {id(s): i for i, s in enumerate(done.rows)}
        if not all(id(s) in row_of or s.prefilling for s in self.scheduler.running):
            return  # a decoding sequence whose next token the host must supply
        if not self.scheduler.could_admit() and not any(
            s.prefilling for s in self.scheduler.running
        ):
            return  # no prompt to prefill: the decode after `done` launches once it is read
        for seq in self.scheduler.admit():
            self._start(seq)
        plan = self.scheduler.plan(self.costs.prefill_tokens if self.costs is not None else None)
        # a row that ends by length in `done` leaves: its next token would be dropped
        going = [s for s in plan.decode if not ends_by_length(s, 1)]
        if plan.prefill and self._may_mix_ahead(going, plan.prefill, 1):
            self._launch_mixed(StepPlan(going, plan.prefill), row_of)

    def _launch_mixed(self, plan: StepPlan, row_of: dict[int, int] | None) -> None:
        """Launch `plan` as one forward without waiting for it; its decode rows' tokens are
        rows `row_of` of the in-flight step's picks, or (None) their last tokens, from here."""
        chunks = [(s, 1) for s in plan.decode] + plan.prefill
        rows, counts = logits_rows(chunks)
        if row_of is None:
            decode_tokens, fed = [[s.output[-1]] for s in plan.decode], []
        else:
            decode_tokens, fed = [[0]] * len(plan.decode), [row_of[id(s)] for s in plan.decode]
        picks = self.runner.launch_prefill(
            [s.slot for s, _ in chunks],
            decode_tokens + [s.next_tokens(n) for s, n in plan.prefill],
            rows,
            fed,
        )
        for seq, n in chunks:
            seq.num_computed += n
        sampled = [s for (s, _), count in zip(chunks, counts, strict=True) if count]
        kind = "mixed" if plan.decode else "prefill"
        info = StepInfo(kind, len(plan.decode), sum(n for _, n in plan.prefill))
        self._ahead = InFlight(sampled, picks, info)

    def _may_mix_ahead(
        self, decode: list[Sequence], prefill: list[tuple[Sequence, int]], unread: int
    ) -> bool:
        """Whether a mixed step of these rows may run without the host reading it first: one
        forward, greedy picks only, no prompt logprobs, and no decode row sure to stop by length
        at the `unread` tokens still in flight."""
        ends = [s for s, n in prefill if n == s.remaining_prompt]
        return (
            self.overlap
            and self.one_forward
            and picks_suffice(decode, self.picker, unread)
            and picks_suffice(ends, self.picker, 0)
            and not any(s.return_prompt_logprobs for s, _ in prefill)
        )
