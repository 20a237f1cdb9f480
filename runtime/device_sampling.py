"""Sampled rows drawn on the device (the artifact's `sampled_pick` and, where a row asks for top_p
or min_p without top_k, `sampled_pick_nucleus`; schedules/sample_pick.py):
after a step's forward, each row whose sequence samples there gets its token and logprob
written into the step's own pick buffers, as a greedy row's pick is. So such a sequence's
steps come back as 8 bytes a row and may be launched ahead, where the host's sampler would
copy its 1 MB row and wait for the GPU every step.

Which settings qualify (`drawn_on_device`): a temperature with top_k off or up to DEVICE_TOP_K,
any top_p (without top_k, a nucleus of any size: schedules/nucleus.py) and any min_p; no
alternatives reported, no grammar. Others stay with the host's sampler (runtime/sampler.py).
Artifacts built before `sampled_pick_nucleus` take (temperature, top_p) a row and draw neither
top_p nor min_p without top_k, nor min_p at all.
A row's randomness is a hash of its request's seed and its token's position, so a seeded
request draws the same tokens whatever else runs beside it."""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm

from .host_picks import DeviceInputs
from .sampler import SamplingParams, is_effectively_greedy

# schedules/sample_pick.K_MAX (the runtime imports no compiler; a test holds them equal)
DEVICE_TOP_K = 64


def needs_nucleus(params: SamplingParams) -> bool:
    """Whether a row's draw needs the nucleus kernels first: its peak or its nucleus (top_p or
    min_p without top_k)."""
    return params.top_k < 1 and (params.top_p < 1.0 or params.min_p > 0.0)


def needs_nucleus_artifact(params: SamplingParams) -> bool:
    """Whether only an artifact with `sampled_pick_nucleus` draws these settings: the nucleus
    kernels, or min_p (the third float a row)."""
    return needs_nucleus(params) or params.min_p > 0.0


def drawn_on_device(params: SamplingParams, decodable: int, nucleus: bool) -> bool:
    """Whether the device's draw gives exactly the distribution these settings ask for;
    `nucleus`: whether the artifact finds nuclei (`sampled_pick_nucleus`)."""
    if is_effectively_greedy(params, decodable):
        return False
    if needs_nucleus_artifact(params) and not nucleus:
        return False
    return params.top_k <= DEVICE_TOP_K  # -1 / 0: off


def seed_words(seed: int) -> tuple[int, int]:
    """A seed as the kernel's two int32 words (low, high) of its 64 bits."""
    u = seed & (2**64 - 1)
    words = np.array([u & 0xFFFFFFFF, u >> 32], dtype=np.uint32).view(np.int32)
    return int(words[0]), int(words[1])


def prefill_draws(
    slots: list[int], lengths: list[int], rows: np.ndarray, positions: np.ndarray
) -> list[tuple[int, int, int]]:
    """(logits row, slot, position of the token drawn) for a prefill's rows that end their
    chunk: the token after a chunk's last one (dropped where the prompt goes on)."""
    ends = np.cumsum(lengths)
    chunk = np.searchsorted(ends, rows, side="right")
    return [
        (i, slots[c], int(positions[t]) + 1)
        for i, (t, c) in enumerate(zip(rows, chunk, strict=True))
        if t == ends[c] - 1
    ]


class DeviceDraws:
    """The slots whose rows are drawn on the device, with their settings, and the artifact's
    kernel; its inputs cross as a step's other int32 inputs do (`DeviceInputs`)."""

    def __init__(self, vm: Any):
        self._fn = vm["sampled_pick"]
        self.finds_nuclei = vm.module.implements_function("sampled_pick_nucleus")
        self._nucleus_fn = vm["sampled_pick_nucleus"] if self.finds_nuclei else None
        self._floats = 3 if self.finds_nuclei else 2  # (temperature, top_p[, min_p]) a row
        self._slots: dict[int, tuple[float, float, float, int, int, int]] = {}
        self._nucleus_slots: set[int] = set()

    def add(self, slot: int, params: SamplingParams, seed: int) -> None:
        if needs_nucleus_artifact(params) and not self.finds_nuclei:
            raise ValueError("this artifact cannot draw these settings on the device")
        lo, hi = seed_words(seed)
        t, p, m = params.temperature, params.top_p, params.min_p
        self._slots[slot] = (t, p, m, params.top_k, lo, hi)
        if needs_nucleus(params):
            self._nucleus_slots.add(slot)

    def remove(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._nucleus_slots.discard(slot)

    def __len__(self) -> int:
        return len(self._slots)

    def draw(
        self,
        logits: tvm.runtime.Tensor,
        best: tvm.runtime.Tensor,
        logprob: tvm.runtime.Tensor,
        rows: list[tuple[int, int, int]],
        inputs: DeviceInputs,
    ) -> None:
        """Queue the draws of (logits row, slot, position of the token drawn) behind the step:
        their tokens and logprobs land in `best` and `logprob` at those rows."""
        rows = [r for r in rows if r[1] in self._slots]
        n = len(rows)
        if not n:
            return
        settings = [self._slots[slot] for _, slot, _ in rows]
        floats = np.array([s[: self._floats] for s in settings], dtype=np.float32)
        ints = [(*s[3:], at) for s, (_, _, at) in zip(settings, rows, strict=True)]
        row_ids, float_bits, int_rows = inputs.upload(
            draw_rows=[r for r, _, _ in rows], draw_floats=floats.view(np.int32), draw_ints=ints
        )
        nuclei = any(slot in self._nucleus_slots for _, slot, _ in rows)
        (self._nucleus_fn if nuclei else self._fn)(
            logits,
            row_ids,
            float_bits._create_view(tvm.runtime.ShapeTuple((n, self._floats)), "float32"),
            int_rows._create_view(tvm.runtime.ShapeTuple((n, 4)), "int32"),
            best,
            logprob,
        )
