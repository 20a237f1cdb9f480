"""A request's state inside the engine, and what each step reports for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from .sampler import SamplingParams, make_rng

if TYPE_CHECKING:
    from .grammar import GrammarState

TopLogprobs = list[tuple[int, float]]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    pages: int  # reserved for prompt + max_tokens at admission
    return_prompt_logprobs: bool = False
    top_logprobs: int = 0  # alternatives reported with each sampled (and prompt) token
    grammar: GrammarState | None = None  # constrains each sampled token (structured output)
    drawn_on_device: bool = False  # its tokens are drawn where its logits are
    status: Status = Status.WAITING
    slot: int = -1
    page_ids: list[int] = field(default_factory=list)  # the KV pages, in order
    num_computed: int = 0  # tokens already in the KV cache and GDN state
    output: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)

    @cached_property
    def rng(self) -> np.random.Generator:
        """The request's generator, made at its first draw: a greedy request never draws, and
        one from OS entropy costs ~40 µs."""
        return make_rng(self.params.seed)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def remaining_prompt(self) -> int:
        return len(self.prompt) - self.num_computed

    def next_tokens(self, n: int) -> list[int]:
        """The `n` tokens to feed next: prompt tokens while prefilling, else the last sample."""
        if self.prefilling:
            return self.prompt[self.num_computed : self.num_computed + n]
        return [self.output[-1]]

    def take(self, token: int, logprob: float, top: TopLogprobs | None) -> Output:
        """Append a sampled token (`top`: its alternatives, where the request asked for them);
        the step's report of it, with the finish reason where it ends the request."""
        self.output.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)  # also starts the next mask, overlapping the next step
        reason = None
        if token in self.stop_ids:
            reason = "stop"
        elif len(self.output) >= self.max_tokens:
            reason = "length"
        first = len(self.output) == 1 and self.return_prompt_logprobs
        return Output(
            self.request_id,
            [token],
            [logprob],
            reason,
            list(self.prompt_logprobs) if first else None,
            None if top is None else [top],
            list(self.prompt_top_logprobs) if first and top is not None else None,
        )


@dataclass(frozen=True)
class Output:
    """New tokens of one request from one step (at most one token per step today)."""

    request_id: int
    token_ids: list[int]
    logprobs: list[float]  # of each new token: log_softmax over the decodable vocabulary
    finish_reason: str | None  # 'stop' | 'length' | 'abort' | None while running
    # Given once, with the first token: None for position 0, then each prompt token's logprob.
    prompt_logprobs: list[float | None] | None = None
    # With `top_logprobs` > 0: the most likely (id, logprob) pairs where each token was chosen,
    # and, with the prompt logprobs, where each prompt token stood.
    top_logprobs: list[TopLogprobs] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_prompt_logprobs: bool = False
    top_logprobs: int = 0
    grammar: GrammarState | None = None  # one per request: matchers hold per-sequence state


@dataclass
class Completion:
    """A request run to its end by `Engine.generate`."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[float | None] | None = None
