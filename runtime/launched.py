"""What a step's forward reads back and what a step launched ahead of the host carries
(runtime/engine.py, `_step_ahead`): the rows a forward makes logits for, and whether a step's
sequences need nothing from the host but the device's greedy picks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .host_picks import PendingPicks
from .sequence import Sequence, Status
from .step_sampling import StepSampler


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


def picks_suffice(seqs: list[Sequence], picker: StepSampler, unread: int) -> bool:
    """Whether each of `seqs` takes the device's greedy pick as its next token (no grammar, no
    alternatives, greedy) and may still have one after `unread` tokens not yet read."""
    return all(
        s.status is Status.RUNNING
        and s.grammar is None
        and picker.wants_pick(s)
        and len(s.output) + unread < s.max_tokens
        for s in seqs
    )
