"""Runs the compiled model over the paged KV cache and pools of GDN state slots.

The runner owns device state; it does not decide what runs. Callers (the single-sequence
generator, the batching engine) give a sequence a slot and its pages, forward token chunks of
several sequences at once, and remove it. The runner remembers how many tokens each slot holds,
which gives every token its position.

Decode runs as one CUDA graph per batch size, so everything it touches lives at a fixed
address: the step's inputs (ids, slots, positions) are copied into one [batch, 3] buffer, and the
logits and greedy picks land in fixed output buffers; each call passes views of them.

`launch_decode` returns before the step runs, bringing back only its greedy picks
(runtime/host_picks.py), and the artifact's `feed_picks` turns the step's inputs into the next
step's on the device (each row's pick, one position on): the host launches step N + 1 before it
reads step N's picks, and the GPU never waits for the host between steady decode steps.
`launch_prefill` does the same for a mixed step (decode rows riding in a prefill): its decode
rows' tokens are copied on the device from the picks of the step in flight. Inputs cross from
page-locked memory, so no launch waits for the step before it.

Constrained rows (structured output) get their token bitmasks applied where the logits are:
`constrain` uploads the rows' masks into a fixed buffer and runs the artifact's
`constrained_pick` (greedy: 8 bytes a row come back) and/or `constrained_mask` (in place, for
rows the host samples) on a decode step's or a prefill's logits, still on the device. Slots
whose settings the device's sampler serves get their rows drawn there, behind each step, into
its pick buffers (runtime/device_sampling.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import tvm

from .artifact import Artifact
from .constrained_rows import DeviceMasks
from .device_sampling import DeviceDraws, prefill_draws
from .host_picks import (
    DeviceInputs,
    PendingPicks,
    PickBuffer,
    StepLogits,
    UploadStaging,
    copy_rows,
    shape_of,
)
from .sampler import SamplingParams

# Decode batches from this size run `decode_wide`: on an H200 the GEMV schedules match cuBLAS
# up to 4 rows and fall to a third of it by 16, where the tensor-core tiles reach 0.9x.
WIDE_DECODE_FROM = 8


INT32 = "int32"


class ModelRunner:
    def __init__(
        self,
        artifact: Artifact,
        max_batch_size: int = 1,
        max_total_tokens: int | None = None,
        num_slots: int | None = None,
    ):
        self.artifact = artifact
        self.device = artifact.device
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens or artifact.context_window
        self.page_size = artifact.page_size
        self.num_slots = num_slots or max_batch_size
        if max_batch_size > artifact.max_decode_batch:
            raise ValueError(
                f"max_batch_size {max_batch_size} exceeds the {artifact.max_decode_batch} "
                "sequences the artifact's decode was compiled for"
            )
        self.total_pages = -(-self.max_total_tokens // self.page_size)
        # A sequence never holds more than one context window (or the whole pool).
        self.pages_per_seq = min(self.total_pages, -(-artifact.context_window // self.page_size))
        # A VM of its own: captured CUDA graphs keep the addresses of this runner's buffers.
        self._vm = vm = artifact.new_vm()
        self._prefill = vm["prefill"]
        # steps of prompt chunks only, where the artifact has such a prefill (bf16 on CUDA):
        # decode's GDN kernel for one-token rows is not launched
        has_prompts = vm.module.implements_function("prefill_prompts")
        self._prefill_prompts = vm["prefill_prompts"] if has_prompts else self._prefill
        self._decode = vm["decode"]
        self._decode_wide = vm["decode_wide"]
        self._reset = vm["reset_gdn_slots"]
        self._assign = vm["assign_pages"]
        shape = tvm.runtime.ShapeTuple
        self.k_pool, self.v_pool, self.page_table = vm["create_kv_pools"](
            shape([self.total_pages]), shape([self.num_slots]), shape([self.pages_per_seq])
        )
        # conv pool, recurrent pool and (artifacts since their decode kernel fused the gated
        # norm) the tickets of its blocks
        self.gdn_state = tuple(vm["create_gdn_pools"](shape([self.num_slots])))
        self._lengths: dict[int, int] = {}  # slot -> tokens in the cache
        self._capacity: dict[int, int] = {}  # slot -> tokens its pages hold
        n, width = max_batch_size, artifact.widths.selection
        self._step_in = tvm.runtime.empty((n, 3), "int32", self.device)
        self._logits = tvm.runtime.empty((n, width), "float32", self.device)
        self._best = tvm.runtime.empty((n,), "int32", self.device)
        self._best_logprob = tvm.runtime.empty((n,), "float32", self.device)
        self._decode_views: dict[int, tuple] = {}
        # launch_decode: steps launched before the host reads the last one's picks. Artifacts
        # built before `feed_picks` lack it; their engine steps synchronously.
        self.launches_ahead = vm.module.implements_function("feed_picks")
        if self.launches_ahead:
            self._feed = vm["feed_picks"]
            # a row a sequence: a mixed step's rows are distinct slots
            rows = max(n, self.num_slots)
            self._pick_buffers = [PickBuffer(rows, self.device) for _ in range(2)]
            # the picks rows a decode behind a step takes, where some rows dropped out
            self._gathered = tvm.runtime.empty((rows,), INT32, self.device)
            self._turn = 0
        self._fed: tuple[int, ...] | None = None  # slots whose next inputs are on the device
        # the device picks of the step launched last, not read by the host, and each row's slot
        self._in_flight: tuple[tvm.runtime.Tensor, tuple[int, ...]] | None = None
        self._staging = UploadStaging(self.device)
        self._inputs = DeviceInputs(self.device, self._staging)  # prefill's, add_sequence's
        # Artifacts built before `sampled_pick` lack it; their sampled rows go to the host.
        self.draws_on_device = vm.module.implements_function("sampled_pick")
        if self.draws_on_device:
            self._draws = DeviceDraws(vm)
        # ... and those before `sampled_pick_nucleus`, their min_p and top_k-off top_p rows
        self.finds_nuclei = self.draws_on_device and self._draws.finds_nuclei
        # Artifacts built before the bitmask kernels lack these; the engine masks on the host.
        self.constrains_on_device = vm.module.implements_function("constrained_pick")
        if self.constrains_on_device:
            self._masks = DeviceMasks(vm, n, artifact.widths.decodable, self.device)

    def capture_decode_graphs(self, batch_sizes: list[int]) -> None:
        """Run `decode` once at each batch size on throw-away sequences, so a CUDA-graph build
        captures its graphs now rather than during the first requests of that size."""
        for batch in batch_sizes:
            if batch > self.num_slots:
                raise ValueError(f"a decode batch of {batch} exceeds the {self.num_slots} slots")
            with self.throwaway(batch) as slots:
                self.decode(slots, [0] * batch)  # rows stay on the device

    @contextlib.contextmanager
    def throwaway(self, batch: int, pages: int = 1) -> Iterator[list[int]]:
        """`batch` empty sequences in the highest slots, each over the highest `pages` pages
        (shared), removed on leaving: for steps whose outputs are dropped (graph capture, step
        timing). Every slot is zeroed again when a sequence takes it."""
        held: list[int] = []
        try:
            for slot in range(self.num_slots - 1, self.num_slots - 1 - batch, -1):
                self.add_sequence(slot, list(range(self.total_pages - pages, self.total_pages)))
                held.append(slot)
            yield held
        finally:
            for slot in held:
                self.remove_sequence(slot)

    def add_sequence(self, slot: int, pages: list[int]) -> None:
        """Start an empty sequence in `slot` over `pages` (its page ids, in order) and zero
        its GDN state."""
        if not 0 <= slot < self.num_slots or slot in self._lengths:
            raise ValueError(f"slot {slot} is taken or outside [0, {self.num_slots})")
        if not 0 < len(pages) <= self.pages_per_seq:
            raise ValueError(f"{len(pages)} pages: a sequence holds 1 to {self.pages_per_seq}")
        slot_ids, page_ids = self._inputs.upload(slot=[slot], pages=pages)
        self._assign(self.page_table, slot_ids, page_ids)
        self._reset(*self.gdn_state[:2], slot_ids)
        self._lengths[slot] = 0
        self._capacity[slot] = len(pages) * self.page_size

    def draw_on_device(self, slot: int, params: SamplingParams, seed: int) -> None:
        """From now until it is removed, `slot`'s rows are drawn on the device with `params`
        (device_sampling.drawn_on_device must hold for them)."""
        if slot not in self._lengths:
            raise ValueError(f"slot {slot} holds no sequence")
        self._draws.add(slot, params, seed)

    def remove_sequence(self, slot: int) -> None:
        del self._lengths[slot], self._capacity[slot]
        if self.draws_on_device:
            self._draws.remove(slot)
        if self._fed is not None and slot in self._fed:
            self._fed = None

    def _advance(self, slots: list[int], lengths: list[int]) -> list[int]:
        """Each sequence's length before this step, counting the step in; refuses a step that
        would write past a sequence's pages (their table entries name other sequences' pages)."""
        starts = []
        for slot, n in zip(slots, lengths, strict=True):
            start = self._lengths[slot]
            if start + n > self._capacity[slot]:
                raise ValueError(
                    f"slot {slot}: {start} + {n} tokens exceed its pages "
                    f"({self._capacity[slot]} tokens)"
                )
            starts.append(start)
        for slot, n in zip(slots, lengths, strict=True):
            self._lengths[slot] += n
        return starts

    def forward(
        self,
        slots: list[int],
        tokens: list[list[int]],
        all_logits: bool = False,
        logit_positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """Append `tokens[b]` to the sequence in `slots[b]`; logits [rows, selection] at each
        sequence's last token, at every token with `all_logits`, or at the given indices into
        the concatenated tokens with `logit_positions`."""
        return self.forward_step(slots, tokens, all_logits, logit_positions).rows()

    def forward_step(
        self,
        slots: list[int],
        tokens: list[list[int]],
        all_logits: bool = False,
        logit_positions: np.ndarray | None = None,
    ) -> StepLogits:
        """`forward`, with the logits left on the device until asked for."""
        lengths = [len(t) for t in tokens]
        # `decode` returns exactly one row per sequence, so anything else runs `prefill`.
        if logit_positions is None and not all_logits and all(n == 1 for n in lengths):
            return self.decode(slots, [t[0] for t in tokens])
        ends = np.cumsum(lengths)
        rows = np.arange(ends[-1]) if all_logits else ends - 1
        if logit_positions is not None:
            rows = np.asarray(logit_positions)
        return self.prefill(slots, tokens, rows)

    def prefill(self, slots: list[int], tokens: list[list[int]], rows: np.ndarray) -> StepLogits:
        """Append `tokens[b]` to the sequence in `slots[b]`; the logits at `rows` (indices into
        the concatenated tokens) stay on the device until asked for."""
        out = self._run_prefill(slots, tokens, rows, [])
        self._in_flight = None
        # Artifacts from before prefill's greedy pick return the logits and the pools only.
        if len(out) == 5:
            self.device.sync()  # as the picks' read below would
            step = StepLogits(out[0])
        else:
            step = StepLogits(out[0], out[1].numpy(), out[2].numpy())
        self._staging.settled()
        return step

    def launch_prefill(
        self, slots: list[int], tokens: list[list[int]], rows: np.ndarray, fed: list[int]
    ) -> PendingPicks:
        """`prefill`, returning before it runs: only each row's greedy pick comes back, as from
        `launch_decode`. The first `len(fed)` chunks are one-token decode rows whose token is
        row `fed[j]` of the picks of the step launched just before, copied on the device (their
        `tokens` entries are not read): the host launches this step before it reads that one's
        picks."""
        if not self.launches_ahead:
            raise RuntimeError("this artifact has no feed_picks; recompile it to launch ahead")
        if fed:
            if self._in_flight is None:
                raise ValueError("no step in flight to take decode rows' tokens from")
            held = self._in_flight[1]
            wrong = [j for j, r in enumerate(fed) if held[r] != slots[j] or len(tokens[j]) != 1]
            if wrong:
                raise ValueError(f"rows {wrong}: fed rows are one-token chunks of their own slots")
        out = self._run_prefill(slots, tokens, rows, fed)
        if len(out) == 5:
            raise RuntimeError("this artifact's prefill makes no greedy picks; recompile it")
        chunk_of_row = np.searchsorted(np.cumsum([len(t) for t in tokens]), rows, side="right")
        self._fed = None
        self._in_flight = (out[1], tuple(slots[c] for c in chunk_of_row))
        return self._fetch(out[1], out[2])

    def _run_prefill(
        self, slots: list[int], tokens: list[list[int]], rows: np.ndarray, fed: list[int]
    ) -> list:
        """Launch one prefill; the first len(fed) tokens are copied from the in-flight picks."""
        starts = self._advance(slots, [len(t) for t in tokens])
        positions = np.concatenate(
            [np.arange(s, s + len(t)) for s, t in zip(starts, tokens, strict=True)]
        )
        inputs = self._inputs.upload(
            tokens=np.concatenate(tokens),
            indptr=np.concatenate([[0], np.cumsum([len(t) for t in tokens])]),
            slots=slots,
            positions=positions,
            rows=rows,
        )
        if fed:
            copy_rows(self._in_flight[0], fed, inputs[0])
        prompts_only = all(len(t) > 1 for t in tokens)
        fn = self._prefill_prompts if prompts_only else self._prefill
        out = fn(*inputs, *self._state())
        if self.draws_on_device and self._draws and len(out) > 5:  # prefill's picks
            drawn = prefill_draws(slots, [len(t) for t in tokens], rows, positions)
            self._draws.draw(out[0], out[1], out[2], drawn, self._inputs)
        return out

    def decode(self, slots: list[int], tokens: list[int]) -> StepLogits:
        """One token for each sequence; the logits stay on the device until asked for."""
        _, logits, best, logprob = self._run_decode(slots, tokens)
        self._fed = self._in_flight = None
        picks = StepLogits(logits, best.numpy(), logprob.numpy())
        self._staging.settled()
        return picks

    def launch_decode(
        self, slots: list[int], tokens: list[int] | None, rows: list[int] | None = None
    ) -> PendingPicks:
        """`decode`, returning before the step runs: only its greedy picks come back, in host
        memory, when `PendingPicks.wait` says. With `tokens` None, slot j's token is row
        `rows[j]` (default j) of the picks of the step launched just before, a decode or a
        prefill, copied on the device: the host launches this step before it reads that one's
        picks, and rows that ended there drop out."""
        if not self.launches_ahead:
            raise RuntimeError("this artifact has no feed_picks; recompile it to launch ahead")
        rows = list(range(len(slots))) if rows is None else rows
        picks = None
        if tokens is None and not (self._fed == tuple(slots) and rows == list(range(len(slots)))):
            held = self._in_flight[1] if self._in_flight is not None else ()
            if len(rows) != len(slots) or any(
                not 0 <= r < len(held) or held[r] != s or s not in self._lengths
                for r, s in zip(rows, slots, strict=False)
            ):
                raise ValueError(f"the device holds the next inputs of slots {held}, not {slots}")
            picks = self._gather(rows)
        _, _, best, logprob = self._run_decode(slots, tokens, picks)
        self._feed(self._views(len(slots))[0], best)
        self._fed = tuple(slots)
        self._in_flight = (best, tuple(slots))
        return self._fetch(best, logprob)

    def _gather(self, rows: list[int]) -> tvm.runtime.Tensor:
        """Rows `rows` of the in-flight picks as one int32 tensor on the device: a view where
        they are its first rows in order, else a copy."""
        src = self._in_flight[0]
        if rows == list(range(len(rows))):
            return src._create_view(shape_of(len(rows)), INT32, 0)
        out = self._gathered._create_view(shape_of(len(rows)), INT32, 0)
        copy_rows(src, rows, out)
        return out

    def _fetch(self, best: tvm.runtime.Tensor, logprob: tvm.runtime.Tensor) -> PendingPicks:
        """A launched step's picks, on their way to the host; its inputs' host memory is kept
        until the step after next (the engine waits for a step before launching that one)."""
        buffer = self._pick_buffers[self._turn]
        self._turn ^= 1
        self._staging.next_turn()
        return buffer.fetch(best, logprob)

    def _run_decode(
        self, slots: list[int], tokens: list[int] | None, picks: tvm.runtime.Tensor | None = None
    ) -> tuple:
        """Launch one decode step; `tokens` None: its inputs are already on the device, or its
        tokens are `picks` (a row a slot), fed in on the device."""
        batch = len(slots)
        if not 0 < batch <= self.max_batch_size:
            raise ValueError(f"decode batch {batch}: 1 to {self.max_batch_size}")
        starts = self._advance(slots, [1] * batch)
        views = step, logits, best, logprob = self._views(batch)
        if tokens is not None or picks is not None:
            # from `picks`: one position short, which feed_picks adds with each row's pick
            first = tokens if tokens is not None else [0] * batch
            at = starts if tokens is not None else [s - 1 for s in starts]
            host = np.array([first, slots, at], dtype=np.int32).T.ravel()
            step.copyfrom(self._staging.put(host, (batch, 3)))
            if tokens is None:
                self._feed(step, picks)
        fn = self._decode_wide if batch >= WIDE_DECODE_FROM else self._decode
        fn(step, logits, best, logprob, *self._state())
        if self.draws_on_device and self._draws:  # drawn: the position after the input's
            drawn = [(j, slot, starts[j] + 1) for j, slot in enumerate(slots)]
            self._draws.draw(logits, best, logprob, drawn, self._inputs)
        return views

    def _views(self, batch: int) -> tuple:
        """decode's buffers for `batch` rows, made once: views of fixed allocations, since a
        captured graph keeps the addresses it was captured with."""
        if batch not in self._decode_views:
            self._decode_views[batch] = (
                self._step_in._create_view((batch, 3)),
                self._logits._create_view((batch, self._logits.shape[1])),
                self._best._create_view((batch,)),
                self._best_logprob._create_view((batch,)),
            )
        return self._decode_views[batch]

    def constrain(
        self, step: StepLogits, rows: list[int], bitmasks: np.ndarray, pick: bool, mask: bool
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Apply `bitmasks` to logits rows `rows` of `step` on the device (DeviceMasks.apply)."""
        return self._masks.apply(step.device_rows(), rows, bitmasks, pick, mask)

    def _state(self) -> tuple:
        return (
            self.k_pool,
            self.v_pool,
            self.page_table,
            *self.gdn_state,
            self.artifact.params,
        )
