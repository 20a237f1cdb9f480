"""Runs the compiled model over a paged KV cache and pools of GDN state slots.

The runner owns device state; it does not decide what runs. Callers (the single-sequence
generator now, the batching engine later) add sequences, forward token chunks of several
sequences at once, and remove them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import tvm
import tvm_ffi

from .artifact import Artifact

_add_sequence = tvm_ffi.get_global_func("vm.builtin.kv_state_add_sequence")
_remove_sequence = tvm_ffi.get_global_func("vm.builtin.kv_state_remove_sequence")
_begin_forward = tvm_ffi.get_global_func("vm.builtin.kv_state_begin_forward")
_end_forward = tvm_ffi.get_global_func("vm.builtin.kv_state_end_forward")
_WARM_UP_IDS = 1 << 40  # beyond any request id
# Decode batches from this size run `decode_wide`: on an H200 the GEMV schedules match cuBLAS
# up to 4 rows and fall to a third of it by 16, where the tensor-core tiles reach 0.9x.
WIDE_DECODE_FROM = 8
_available_pages = tvm_ffi.get_global_func("vm.builtin.attention_kv_cache_get_num_available_pages")


class ModelRunner:
    def __init__(
        self,
        artifact: Artifact,
        max_batch_size: int = 1,
        max_total_tokens: int | None = None,
        prefill_chunk: int = 2048,
        page_size: int = 16,
        num_slots: int | None = None,
    ):
        self.artifact = artifact
        self.device = artifact.device
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens or artifact.context_window
        self.prefill_chunk = prefill_chunk
        self.page_size = page_size
        self.num_slots = num_slots or max_batch_size
        if max_batch_size > artifact.max_decode_batch:
            raise ValueError(
                f"max_batch_size {max_batch_size} exceeds the {artifact.max_decode_batch} "
                "sequences the artifact's decode was compiled for"
            )
        # A VM of its own: captured CUDA graphs keep the addresses of this runner's pools.
        self._vm = vm = artifact.new_vm()
        self._prefill = vm["prefill"]
        self._decode = vm["decode"]
        self._decode_wide = vm["decode_wide"]
        self._reset = vm["reset_gdn_slots"]
        self.kv_cache = vm["create_kv_cache"](
            tvm.runtime.ShapeTuple([max_batch_size]),
            tvm.runtime.ShapeTuple([self.max_total_tokens]),
            tvm.runtime.ShapeTuple([prefill_chunk]),
            tvm.runtime.ShapeTuple([page_size]),
        )
        self.conv_pool, self.rec_pool = vm["create_gdn_pools"](
            tvm.runtime.ShapeTuple([self.num_slots])
        )

    def capture_decode_graphs(self, batch_sizes: list[int]) -> None:
        """Run `decode` once at each batch size on throw-away sequences, so a CUDA-graph build
        captures its graphs now rather than during the first requests of that size. Uses the
        highest slots and sequence ids; every slot is zeroed again when a sequence takes it."""
        for batch in batch_sizes:
            seq_ids = [_WARM_UP_IDS + i for i in range(batch)]
            slots = [self.num_slots - 1 - i % self.num_slots for i in range(batch)]
            for seq_id, slot in zip(seq_ids, slots, strict=True):
                self.add_sequence(seq_id, slot)
            try:
                self.decode(seq_ids, slots, [0] * batch)  # rows stay on the device
            finally:
                for seq_id in seq_ids:
                    self.remove_sequence(seq_id)

    def _i32(self, values) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.asarray(values, dtype=np.int32), self.device)

    def add_sequence(self, seq_id: int, slot: int) -> None:
        """Register a sequence and zero its GDN state slot."""
        _add_sequence(self.kv_cache, seq_id)
        self._reset(self.conv_pool, self.rec_pool, self._i32([slot]))

    def remove_sequence(self, seq_id: int) -> None:
        _remove_sequence(self.kv_cache, seq_id)

    def available_pages(self) -> int:
        """Free pages as the KV cache itself counts them."""
        return int(_available_pages(self.kv_cache))

    def forward(
        self,
        seq_ids: list[int],
        slots: list[int],
        tokens: list[list[int]],
        all_logits: bool = False,
        logit_positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """Append `tokens[b]` to sequence `seq_ids[b]`; logits [rows, selection] at each
        sequence's last token, at every token with `all_logits`, or at the given indices into
        the concatenated tokens with `logit_positions`."""
        lengths = [len(t) for t in tokens]
        # `decode` returns exactly one row per sequence, so anything else runs `prefill`.
        if logit_positions is None and not all_logits and all(n == 1 for n in lengths):
            return self.decode(seq_ids, slots, [t[0] for t in tokens]).rows()
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        positions = np.arange(indptr[-1]) if all_logits else indptr[1:] - 1
        if logit_positions is not None:
            positions = np.asarray(logit_positions)
        ids = self._i32(np.concatenate(tokens))
        with self._step(seq_ids, lengths):
            out = self._prefill(
                ids, self._i32(indptr), self._i32(slots), self._i32(positions), *self._state()
            )
        return out[0].numpy()

    def decode(self, seq_ids: list[int], slots: list[int], tokens: list[int]) -> StepLogits:
        """One token for each sequence; the logits stay on the device until asked for."""
        fn = self._decode_wide if len(seq_ids) >= WIDE_DECODE_FROM else self._decode
        with self._step(seq_ids, [1] * len(seq_ids)):
            out = fn(self._i32(tokens), self._i32(slots), *self._state())
        return StepLogits(out[0], out[1].numpy(), out[2].numpy())

    def _state(self) -> tuple:
        return (self.kv_cache, self.conv_pool, self.rec_pool, self.artifact.params)

    @contextmanager
    def _step(self, seq_ids: list[int], lengths: list[int]) -> Iterator[None]:
        _begin_forward(
            self.kv_cache, tvm.runtime.ShapeTuple(seq_ids), tvm.runtime.ShapeTuple(lengths)
        )
        try:
            yield
        finally:
            _end_forward(self.kv_cache)


class StepLogits:
    """Logits rows of one forward. A decode step's stay on the device until `rows()` is called
    and come with each row's greedy pick (token id, logprob over the decodable columns)."""

    def __init__(
        self,
        rows: tvm.runtime.Tensor | np.ndarray,
        best: np.ndarray | None = None,
        best_logprob: np.ndarray | None = None,
    ):
        self._rows = rows
        self.best = best
        self.best_logprob = best_logprob

    def rows(self) -> np.ndarray:
        if not isinstance(self._rows, np.ndarray):
            self._rows = self._rows.numpy()
        return self._rows
