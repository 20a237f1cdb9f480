"""One HTTP request's generation: its sequences (prompts x n) submitted to the engine loop,
their outputs turned into per-choice text deltas, and their cleanup however it ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request

from qwen35_tvm.runtime.generate import PromptError
from qwen35_tvm.runtime.sequence import Request as EngineRequest
from qwen35_tvm.runtime.sequence import TopLogprobs
from qwen35_tvm.runtime.tokenizer import TextTokenizer

from .engine_loop import Delta, EngineFailure, EngineLoop, QueueFull
from .errors import APIError
from .metrics import Metrics
from .stream import TextStream


@dataclass
class Choice:
    index: int
    prompt_index: int
    request_id: int
    text: TextStream
    stop_ids: frozenset[int]
    discard: bool  # echo with max_tokens 0: the one sampled token is not part of the answer
    submitted: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_tops: list[TopLogprobs | None] | None = None
    first_at: float | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class ChoiceDelta:
    """What one engine output added to one choice."""

    choice: Choice
    text: str
    start: int  # index into choice.token_ids of the first new token
    first: bool  # the first delta of this choice (carries prompt logprobs)
    finish_reason: str | None


class Generation:
    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: TextTokenizer,
        metrics: Metrics,
        prompts: Sequence[list[int]],
        jobs_per_prompt: Sequence[Sequence[EngineRequest]],
        stops: Sequence[str],
        discard_output: bool = False,
    ) -> None:
        self.loop = loop
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.prompts = [list(p) for p in prompts]
        self._jobs = [list(js) for js in jobs_per_prompt]
        self._stops = list(stops)
        self._discard = discard_output
        self.choices: list[Choice] = []
        self._by_rid: dict[int, Choice] = {}
        self._queue: asyncio.Queue | None = None
        self._open: set[int] = set()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    async def start(self) -> None:
        """Submit every sequence; a refused prompt or a full queue becomes an `APIError`."""
        flat = [job for jobs in self._jobs for job in jobs]
        if len(flat) > self.loop.max_waiting:  # could never be queued, however long one waits
            raise APIError(
                400,
                f"{len(flat)} sequences (prompts x n) exceed the queue of {self.loop.max_waiting}",
                "n",
            )
        try:
            ids, self._queue = await self.loop.submit(flat)
        except PromptError as err:
            msg = str(err)
            param = "max_tokens" if msg.startswith("max_tokens") else "prompt"
            raise APIError(400, msg, param, "invalid_prompt") from None
        except QueueFull as err:
            raise APIError(
                503,
                f"the server is busy ({err}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        now = time.monotonic()
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        rids = iter(ids)
        for p, jobs in enumerate(self._jobs):
            for job in jobs:
                rid = next(rids)
                eos = () if job.ignore_eos else self.loop.engine.artifact.eos_token_ids
                choice = Choice(
                    index=len(self.choices),
                    prompt_index=p,
                    request_id=rid,
                    text=TextStream(self.tokenizer, self._stops),
                    stop_ids=frozenset([*eos, *(job.stop_token_ids or ())]),
                    discard=self._discard,
                    submitted=now,
                )
                self.choices.append(choice)
                self._by_rid[rid] = choice
                self._open.add(rid)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Choice deltas as the engine produces them, until every choice has finished."""
        assert self._queue is not None, "start() first"
        while self._open:
            item = await self._queue.get()
            if isinstance(item, EngineFailure):
                self._open.clear()
                raise APIError(500, str(item), code="engine_failure")
            choice = self._by_rid[item.output.request_id]
            if choice.request_id not in self._open:
                continue  # outputs already in flight when we stopped it
            yield self._apply(choice, item)

    def _apply(self, c: Choice, item: Delta) -> ChoiceDelta:
        out = item.output
        first = c.first_at is None
        if first:
            c.first_at = item.at
            c.prompt_logprobs = out.prompt_logprobs
            c.prompt_tops = item.prompt_tops
        start = len(c.token_ids)
        text = ""
        if not c.discard:
            for i, token in enumerate(out.token_ids):
                c.token_ids.append(token)
                c.logprobs.append(out.logprobs[i])
                if i < len(item.tops):
                    c.tops.append(item.tops[i])
                ended_on_stop_id = out.finish_reason == "stop" and token in c.stop_ids
                if not ended_on_stop_id:  # the stop token's text is not part of the answer
                    text += c.text.feed(token)
        reason = None
        if c.text.stopped:
            reason = "stop"
            self.loop.abort([c.request_id])
        elif out.finish_reason is not None:
            reason = "length" if c.discard or out.finish_reason == "length" else "stop"
            text += c.text.finish()
        if reason is not None:
            c.finish_reason = reason
            self._open.discard(c.request_id)
            ttft = c.first_at - c.submitted
            self.metrics.observe(ttft, item.at - c.submitted, len(c.token_ids))
        return ChoiceDelta(c, text, start, first, reason)

    def close(self) -> None:
        """Abort whatever is still running (client gone, error, or cancelled)."""
        if self._open:
            self.loop.abort(sorted(self._open))
            stopped = [c for c in self.choices if c.request_id in self._open]
            self.metrics.generated_tokens.inc(sum(len(c.token_ids) for c in stopped))
            self._open.clear()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(gen: Generation, request: Request) -> None:
    """Run a generation to its end, aborting it if the client goes away first."""

    async def drain() -> None:
        async for _ in gen.deltas():
            pass

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
        gen.close()
    if not work.cancelled() and work.done():
        work.result()  # re-raises an engine failure
    else:
        raise APIError(499, "client closed the request")
