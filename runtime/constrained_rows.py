"""A step's constrained rows (structured output): their token bitmasks applied where the logits
are, so a greedy row brings back only its masked pick and a sampled row is masked before the
host copies it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import tvm

if TYPE_CHECKING:
    from .host_picks import StepLogits
    from .model_runner import ModelRunner


class DeviceMasks:
    """The artifact's bitmask kernels (`constrained_pick`, `constrained_mask`) and their inputs'
    fixed buffers, `rows` logits rows a call."""

    def __init__(self, vm: Any, rows: int, decodable: int, device: Any):
        self._pick, self._mask = vm["constrained_pick"], vm["constrained_mask"]
        words = (decodable + 31) // 32
        self._rows = tvm.runtime.empty((rows,), "int32", device)
        self._bits = tvm.runtime.empty((rows, words), "int32", device)
        self._best = tvm.runtime.empty((rows,), "int32", device)
        self._logprob = tvm.runtime.empty((rows,), "float32", device)

    def apply(
        self, logits: Any, rows: list[int], bitmasks: np.ndarray, pick: bool, mask: bool
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Apply `bitmasks` [len(rows), words] (xgrammar's layout) to rows `rows` of `logits`
        on the device: with `pick`, return each row's greedy pick and its logprob in the
        masked distribution; with `mask`, write -inf over the forbidden columns in place, so
        the rows the host copies afterwards are masked. Pad columns are never touched."""
        n = len(rows)
        if not 0 < n <= self._rows.shape[0]:
            raise ValueError(f"{n} constrained rows: 1 to {self._rows.shape[0]}")
        row_ids = self._rows._create_view((n,))
        row_ids.copyfrom(np.asarray(rows, dtype=np.int32))
        bits = self._bits._create_view((n, self._bits.shape[1]))
        bits.copyfrom(np.ascontiguousarray(bitmasks, dtype=np.int32))
        picked = None
        if pick:  # before the in-place mask: it reads the logits the mask would overwrite
            best, logprob = self._best._create_view((n,)), self._logprob._create_view((n,))
            self._pick(logits, row_ids, bits, best, logprob)
            picked = best.numpy(), logprob.numpy()
        if mask:
            self._mask(logits, row_ids, bits)
        return picked


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
