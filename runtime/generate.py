"""One sequence at a time: prefill, decode, sample, and teacher-forced scoring."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .artifact import Artifact
from .model_runner import ModelRunner
from .sampler import Sampler, SamplingParams, make_rng

_SLOT = 0


class PromptError(ValueError):
    """A prompt the model cannot take; the message says why."""


@dataclass(frozen=True)
class TokenScore:
    position: int
    token: int
    logprob: float | None  # None for the first token, which nothing predicts
    top: list[tuple[int, float]]


class Generator:
    def __init__(self, artifact: Artifact, prefill_chunk: int = 512):
        self.artifact = artifact
        self.decodable = artifact.widths.decodable
        self.prefill_chunk = prefill_chunk
        self.runner = ModelRunner(artifact, max_batch_size=1)
        self.sampler = Sampler(self.decodable)

    def check_prompt(self, ids: Sequence[int], max_tokens: int = 0) -> None:
        if len(ids) == 0:
            raise PromptError("the prompt is empty")
        bad = [i for i in ids if not 0 <= int(i) < self.decodable]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary [0, {self.decodable})")
        window = self.artifact.context_window
        if len(ids) + max_tokens > window:
            raise PromptError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context window of {window} tokens"
            )

    def _session(self) -> _Session:
        return _Session(self.runner, self.prefill_chunk)

    def logits(self, ids: Sequence[int], decode_from: int | None = None) -> np.ndarray:
        """Teacher-forced logits [len(ids), selection]: prefill `ids[:decode_from]` (all of
        it by default), then feed the rest one token at a time."""
        self.check_prompt(ids)
        split = len(ids) if decode_from is None else decode_from
        with self._session() as s:
            rows = [s.prefill(list(ids[:split]), all_logits=True)] if split else []
            rows += [s.step(int(t))[None] for t in ids[split:]]
        return np.concatenate(rows, axis=0)

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        stop_ids: Sequence[int] | None = None,
    ) -> Iterator[int]:
        """Yield sampled token ids until a stop id (yielded too) or `max_tokens`."""
        self.check_prompt(prompt, max_tokens)
        stops = set(self.artifact.eos_token_ids if stop_ids is None else stop_ids)
        rng = make_rng(params.seed)
        with self._session() as s:
            logits = s.prefill(list(prompt))[0]
            for n in range(max_tokens):
                token = self.sampler.sample(logits, params, rng)
                yield token
                if token in stops or n + 1 == max_tokens:
                    return
                logits = s.step(token)

    def score(self, ids: Sequence[int], top_k: int = 0) -> list[TokenScore]:
        """Each position's logprob given the tokens before it, with the top-k alternatives."""
        logits = self.logits(ids)
        out = [TokenScore(0, int(ids[0]), None, [])]
        for pos in range(1, len(ids)):
            row = logits[pos - 1]
            lp = self.sampler.logprobs(row)
            top = self.sampler.top_logprobs(row, top_k) if top_k else []
            out.append(TokenScore(pos, int(ids[pos]), float(lp[ids[pos]]), top))
        return out


class _Session:
    """One live sequence in slot 0, holding every page; removed however the caller exits."""

    def __init__(self, runner: ModelRunner, chunk: int):
        self.runner = runner
        self.chunk = chunk

    def __enter__(self) -> _Session:
        self.runner.add_sequence(_SLOT, list(range(self.runner.pages_per_seq)))
        return self

    def __exit__(self, *exc) -> None:
        self.runner.remove_sequence(_SLOT)

    def prefill(self, ids: list[int], all_logits: bool = False) -> np.ndarray:
        rows = []
        for start in range(0, len(ids), self.chunk):
            part = ids[start : start + self.chunk]
            rows.append(self.runner.forward([_SLOT], [part], all_logits=all_logits))
        return np.concatenate(rows, axis=0) if all_logits else rows[-1]

    def step(self, token: int) -> np.ndarray:
        return self.runner.forward([_SLOT], [[token]])[0]
