"""How a step's ready rows become tokens. A greedy sequence that wants no alternatives takes
the pick the device made, and so does one whose draws the device makes
(runtime/device_sampling.py); a constrained row gets its grammar's bitmask where its logits are
(runtime/constrained_rows.py) and never the plain pick; the others copy their whole row to the
host and sample it there with their own parameters and generator. Prompt logprobs are read
from a prefill chunk's rows here too."""

from __future__ import annotations

from typing import Any

import numpy as np

from .constrained_rows import apply_bitmasks
from .device_sampling import drawn_on_device
from .grammar import apply_bitmask  # numpy only: xgrammar loads with the first grammar
from .host_picks import StepLogits
from .model_runner import ModelRunner
from .sampler import Sampler, is_effectively_greedy
from .sequence import Sequence

# A sequence to sample, the logits of its step and its row among them.
Ready = tuple[Sequence, StepLogits, int]
# A sequence's new token, its logprob and (sampled on the host) its logits row.
Picked = tuple[Sequence, int, float, np.ndarray | None]


class StepSampler:
    def __init__(self, runner: ModelRunner, sampler: Sampler, decodable: int) -> None:
        self.runner, self.sampler, self.decodable = runner, sampler, decodable

    def admit(self, seq: Sequence) -> None:
        """`seq` just took its slot: where the device can draw its tokens, it will."""
        if (
            self.runner.draws_on_device
            and not seq.top_logprobs
            and seq.grammar is None
            and drawn_on_device(seq.params, self.decodable, self.runner.finds_nuclei)
        ):
            seed = seq.params.seed
            if seed is None:
                seed = int(seq.rng.integers(0, 2**63))
            self.runner.draw_on_device(seq.slot, seq.params, seed)
            seq.drawn_on_device = True

    def wants_pick(self, seq: Sequence) -> bool:
        """Whether the device's pick (greedy, or drawn there) is all `seq` needs."""
        if seq.drawn_on_device:
            return True
        return not seq.top_logprobs and is_effectively_greedy(seq.params, self.decodable)

    def pick(self, ready: list[Ready]) -> list[Picked]:
        """Each ready sequence's next token."""
        constrained = self._constrain(ready)
        picked: list[Picked] = []
        for seq, logits, i in ready:
            done = constrained.get((id(logits), i))
            if isinstance(done, tuple):  # the masked pick, made on the device
                picked.append((seq, done[0], done[1], None))
                continue
            if done is None and logits.best is not None and self.wants_pick(seq):
                picked.append((seq, int(logits.best[i]), float(logits.best_logprob[i]), None))
                continue
            row = logits.row(i)
            if isinstance(done, np.ndarray):  # logits on the host, or no device kernels
                apply_bitmask(row, done, self.decodable)  # the row is this sequence's alone
            token = self.sampler.sample(row, seq.params, seq.rng)
            picked.append((seq, token, self.sampler.logprob(row, token), row))
        return picked

    def score_prompt(self, seq: Sequence, rows: np.ndarray) -> None:
        """Row j of the chunk predicts the prompt token after position start + j."""
        start = seq.num_computed
        if start == 0:
            seq.prompt_logprobs.append(None)  # nothing predicts the first token
            seq.prompt_top_logprobs.append(None)
        for j, row in enumerate(rows):
            nxt = start + j + 1
            if nxt < len(seq.prompt):
                seq.prompt_logprobs.append(self.sampler.logprob(row, seq.prompt[nxt]))
                if seq.top_logprobs:
                    seq.prompt_top_logprobs.append(self.sampler.top_logprobs(row, seq.top_logprobs))

    def _constrain(self, ready: list[Ready]) -> dict[tuple[int, int], Any]:
        """The constrained rows' bitmasks, applied where the logits are. Rows whose grammar
        allows everything are left out."""
        groups: dict[int, tuple[StepLogits, list[tuple[int, np.ndarray, bool]]]] = {}
        for seq, logits, i in ready:
            bits = seq.grammar.bitmask() if seq.grammar is not None else None
            if bits is not None:  # waited for the worker, which ran while the GPU stepped
                entry = (i, bits, self.wants_pick(seq))
                groups.setdefault(id(logits), (logits, []))[1].append(entry)
        return apply_bitmasks(self.runner, groups)
