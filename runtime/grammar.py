"""Constrained decoding with xgrammar: grammars compiled once per spec, one matcher per sequence.

A `GrammarState` is what the engine sees: `bitmask()` is the next token's mask in xgrammar's
layout (bit j % 32 of int32 word j // 32 set when token j is allowed), which the engine uploads
and applies on the device (schedules/greedy.py); `mask(row)` applies it to a host row instead
(artifacts built before the device kernels); `accept(token)` advances the matcher. The next
bitmask is computed on a worker thread right after `accept`, so it overlaps the next forward
pass instead of delaying it. The mask covers `decodable` columns only: the arena's pad columns
are never touched (they stay -inf). Only numpy is used here: xgrammar fills a numpy array
through DLPack, so the runtime needs no torch of its own.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from tokenizers import Tokenizer

# Chat markup the grammars spell out; every other added special token is never allowed.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

_MASKING = True  # a test-only switch: False leaves logits unmasked (the mutation check)
# xgrammar's calls release the GIL: masks of a batch's sequences are filled in parallel.
_POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="grammar")


def _xgrammar() -> Any:
    """xgrammar (and the torch and transformers it imports) load with the first constrained
    request, so the engine and a server that never sees one, or a bundle packed without them,
    start without."""
    try:
        import xgrammar
    except ImportError as err:  # `import xgrammar` also imports torch and transformers
        raise ValueError(
            f"structured output needs xgrammar (with torch and transformers, which it imports); "
            f"{err.name or 'it'} is not installed"
        ) from err
    return xgrammar


def set_masking(enabled: bool) -> None:
    """Test hook: turn the bitmask off to show what the grammar is responsible for."""
    global _MASKING
    _MASKING = enabled


def tokenizer_info(tokenizer: Tokenizer, decodable: int, stop_ids: Sequence[int]) -> Any:
    """xgrammar's view of the vocabulary: byte-level strings by id, control tokens as ''
    (xgrammar treats empty tokens as special, never allowed inside text)."""
    vocab = [""] * decodable
    for token, tid in tokenizer.get_vocab(with_added_tokens=True).items():
        if tid < decodable:
            vocab[tid] = token
    for tid, added in tokenizer.get_added_tokens_decoder().items():
        if tid < decodable and added.special and added.content not in MARKUP_TOKENS:
            vocab[tid] = ""
    xgr = _xgrammar()
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.BYTE_LEVEL,
        vocab_size=decodable,
        stop_token_ids=list(stop_ids),
    )


def apply_bitmask(row: np.ndarray, bits: np.ndarray, decodable: int) -> None:
    """The host's mask: -inf over the decodable columns of `row` that `bits` forbids (the
    device does the same in schedules/greedy.py)."""
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:decodable]
    row[:decodable][allowed == 0] = -np.inf


class GrammarCompiler:
    """Compiles structural-tag specs (plain JSON-able dicts) to grammars, cached by spec."""

    def __init__(self, tokenizer: Tokenizer, decodable: int, stop_ids: Sequence[int]) -> None:
        self.decodable = decodable
        self._vocab = (tokenizer, decodable, list(stop_ids))
        self._compiler: Any = None  # built with the first grammar
        self._cache: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.compilations = 0  # grammars actually compiled (cache misses)

    def compile(self, spec: Mapping[str, Any]) -> Any:
        """A compiled grammar for a structural tag; raises ValueError for a bad spec. Requests
        that ask for the same spec at once wait for one compilation."""
        key = json.dumps(spec)  # key order kept: a schema's property order is its output order
        with self._lock:
            if self._compiler is None:
                self._compiler = _xgrammar().GrammarCompiler(tokenizer_info(*self._vocab))
            pending = self._cache.get(key)
            owner = pending is None
            if owner:
                pending = self._cache[key] = Future()
        if owner:
            try:
                pending.set_result(self._compiler.compile_structural_tag(key))
                self.compilations += 1
            except Exception as err:  # xgrammar raises several types for a spec it rejects
                with self._lock:
                    del self._cache[key]  # not cached: the next request gets the error too
                lines = str(err).strip().splitlines()
                pending.set_exception(ValueError(lines[-1] if lines else repr(err)))
        return pending.result()

    def state(self, compiled: Any) -> GrammarState:
        return GrammarState(compiled, self.decodable)


class GrammarState:
    """One sequence's matcher and its next-token bitmask."""

    def __init__(self, compiled: Any, decodable: int) -> None:
        self.decodable = decodable
        self._matcher = _xgrammar().GrammarMatcher(compiled)
        self._bitmask = np.full((1, (decodable + 31) // 32), -1, dtype=np.int32)
        self._ready = False  # the last fill's result: a mask to apply
        self.broken = False  # a token the grammar refused was accepted (masking switched off)
        self.accepted = 0  # tokens the grammar accepted (the stop token that ends it included)
        self._next: Future | None = _POOL.submit(self._fill)

    def _fill(self) -> bool:
        """Compute the bitmask for the next token; False when it allows every token (nothing
        to apply) or once nothing more is constrained."""
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.fill_next_token_bitmask(self._bitmask))

    def _settle(self) -> None:
        """Wait for the worker's pending accept and fill, if any."""
        if self._next is not None:
            self._ready = self._next.result()
            self._next = None

    @property
    def active(self) -> bool:
        """True while the grammar still constrains tokens (not terminated, not broken)."""
        self._settle()
        return not (self.broken or self._matcher.is_terminated())

    def bitmask(self) -> np.ndarray | None:
        """The next token's mask, [ceil(decodable / 32)] int32 (valid until `accept`), or None
        when there is nothing to apply. Waits for the worker, which ran while the GPU stepped."""
        self._settle()
        if not self._ready or self.broken or not _MASKING:
            return None
        return self._bitmask[0]

    def mask(self, row: np.ndarray) -> None:
        """Forbid, in place, the decodable columns the grammar does not allow next."""
        bits = self.bitmask()
        if bits is not None:
            apply_bitmask(row, bits, self.decodable)

    def accept(self, token: int) -> None:
        """Hand the chosen token to the worker, which advances the matcher and computes the
        next mask while the next step runs on the GPU: the step loop never waits on xgrammar
        until it needs the mask."""
        self._settle()
        self._next = _POOL.submit(self._advance, int(token))

    def _advance(self, token: int) -> bool:
        if self.broken or self._matcher.is_terminated():
            return False
        if not self._matcher.accept_token(token):
            self.broken = True
            return False
        self.accepted += 1
        return self._fill()
