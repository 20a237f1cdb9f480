"""A step's constrained rows (structured output): their token bitmasks applied where the logits
are, so a greedy row brings back only its masked pick and a sampled row is masked before the
host copies it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .host_picks import StepLogits
    from .model_runner import ModelRunner

# id(step) -> (the step's logits, [(row, its bitmask, whether it takes the greedy pick)])
Groups = dict[int, tuple["StepLogits", list[tuple[int, np.ndarray, bool]]]]


def apply_bitmasks(runner: ModelRunner, groups: Groups) -> dict[tuple[int, int], Any]:
    """Keyed by (id(step), row): a (token, logprob) picked on the device; True, masked in place
    on the device; or the bitmask itself, for the host to apply (logits already on the host,
    or an artifact without the kernels). At most a decode batch of rows a kernel call."""
    done: dict[tuple[int, int], Any] = {}
    limit = runner.max_batch_size
    for key, (logits, rows) in groups.items():
        if not (runner.constrains_on_device and logits.on_device):
            done.update(((key, i), bits) for i, bits, _ in rows)
            continue
        for part in (rows[k : k + limit] for k in range(0, len(rows), limit)):
            ids, masks, wants = zip(*part, strict=True)
            picks = runner.constrain(
                logits, list(ids), np.stack(masks), pick=any(wants), mask=not all(wants)
            )
            for j, i in enumerate(ids):
                done[key, i] = (int(picks[0][j]), float(picks[1][j])) if wants[j] else True
    return done
