"""The page manager: KV pages and GDN state slots, and sizing them from a byte budget.

This is the only bookkeeping of pages there is: the artifact's page pools are plain tensors
and the page table is written from here. A request gets its whole worst case (prompt +
max_tokens) at admission, as a list of page ids, so a running sequence can never run out of
pages mid-generation and nothing ever has to be evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm

from .artifact import Artifact

PAGE_SIZE = 16
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


class CapacityPool:
    """Free page ids and free GDN slots; every reservation is returned whole."""

    def __init__(self, total_pages: int, num_slots: int):
        if total_pages < 1 or num_slots < 1:
            raise ValueError(f"need >= 1 page and slot, got {total_pages} and {num_slots}")
        self.total_pages = total_pages
        self.num_slots = num_slots
        # Both popped from the end: page 0 and slot 0 go first, and what was just freed is
        # reused next.
        self._free_page_ids = list(range(total_pages - 1, -1, -1))
        self._free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free_page_ids)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def can_reserve(self, pages: int) -> bool:
        return pages <= self.free_pages and bool(self._free_slots)

    def reserve(self, pages: int) -> tuple[int, list[int]]:
        """Take `pages` pages and one slot; returns the slot and the page ids, in order."""
        if not self.can_reserve(pages):
            raise RuntimeError(f"cannot reserve {pages} pages and a slot: {self}")
        taken = [self._free_page_ids.pop() for _ in range(pages)]
        return self._free_slots.pop(), taken

    def release(self, pages: list[int], slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"slot {slot} released twice or never reserved")
        if len(self._free_page_ids) + len(pages) > self.total_pages:
            raise RuntimeError("pages released twice")
        self._free_slots.append(slot)
        self._free_page_ids.extend(reversed(pages))

    def __repr__(self) -> str:
        return (
            f"CapacityPool({self.free_pages}/{self.total_pages} pages, "
            f"{self.free_slots}/{self.num_slots} slots free)"
        )


def kv_bytes_per_token(artifact: Artifact) -> int:
    """K and V of every full-attention layer for one token."""
    cfg = artifact.config
    n_full = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    dtype_bytes = _DTYPE_BYTES[artifact.dtype]
    return 2 * n_full * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes


def gdn_bytes_per_slot(artifact: Artifact) -> int:
    """Conv and recurrent state (and decode's tickets) of one slot, measured on pools the
    artifact itself creates (so this never restates the model's pool shapes)."""
    pools = artifact.vm["create_gdn_pools"](tvm.runtime.ShapeTuple([1]))
    return sum(_numel(p.shape) * _DTYPE_BYTES[str(p.dtype)] for p in pools)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass(frozen=True)
class CapacityPlan:
    max_total_tokens: int
    num_slots: int


def plan_capacity(
    artifact: Artifact, budget_bytes: int, max_batch_size: int, page_size: int = PAGE_SIZE
) -> CapacityPlan:
    """Split a byte budget: one GDN slot per batch entry (more could never run at once), the
    rest as whole KV pages. Requests longer than the pages are refused at submit."""
    slots_bytes = max_batch_size * gdn_bytes_per_slot(artifact)
    page_bytes = page_size * kv_bytes_per_token(artifact)
    pages = (budget_bytes - slots_bytes) // page_bytes
    if pages < 1:
        raise ValueError(
            f"a budget of {budget_bytes} bytes leaves no KV page ({page_bytes} bytes) after "
            f"{max_batch_size} GDN slots ({slots_bytes} bytes)"
        )
    return CapacityPlan(max_total_tokens=int(pages) * page_size, num_slots=max_batch_size)


def plan_from_free_memory(
    artifact: Artifact, fraction: float, max_batch_size: int, page_size: int
) -> CapacityPlan:
    """Size the pools from `fraction` of the device memory free now (weights already loaded);
    the rest is left for activations and the compiled functions' workspace."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
    free = artifact.device.available_global_memory
    if not free:
        raise ValueError(f"{artifact.device_name} does not report its free memory")
    return plan_capacity(artifact, int(free * fraction), max_batch_size, page_size)
