"""OpenAI response JSON for completions, whole or as stream chunks, and the envelope that chat
completions (`chat_shaper.py`) share."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from qwen35_tvm.runtime.tokenizer import TextTokenizer

from .serving import Choice, ChoiceDelta, Generation


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def usage(gen: Generation) -> dict[str, int]:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class Shaper:
    """Shared by both formats: ids, token strings and the common envelope."""

    object_name = ""
    chunk_name = ""

    def __init__(self, tokenizer: TextTokenizer, model: str, gen: Generation, top: int | None):
        self.tok = tokenizer
        self.model = model
        self.gen = gen
        self.top = top  # None: no logprobs asked for
        self.id = new_id(self.prefix)
        self.created = int(time.time())

    prefix = "cmpl"

    def token_text(self, token: int) -> str:
        return self.tok.decode([token])

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.chunk_name if chunk else self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self) -> dict[str, Any]:
        body = self.envelope([], chunk=True)
        body["usage"] = usage(self.gen)
        return body


class CompletionShaper(Shaper):
    object_name = chunk_name = "text_completion"
    prefix = "cmpl"

    def __init__(self, *args: Any, echo: bool, prompt_texts: list[str], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.prompt_texts = prompt_texts

    def _tops(self, pairs: list[tuple[int, float]] | None, token: int, lp: float | None):
        if pairs is None or lp is None:
            return None
        out = {self.token_text(t): v for t, v in pairs}
        out.setdefault(self.token_text(token), lp)  # the chosen token is always listed
        return out

    def _logprobs(self, c: Choice, start: int, with_prompt: bool, offset: int) -> dict[str, Any]:
        tokens: list[int] = []
        lps: list[float | None] = []
        tops: list[list[tuple[int, float]] | None] = []
        if with_prompt:
            prompt = self.gen.prompts[c.prompt_index]
            plp = c.prompt_logprobs or [None] * len(prompt)
            ptops = c.prompt_tops or [None] + [[]] * (len(prompt) - 1)
            tokens += prompt
            lps += plp
            tops += ptops
        tokens += c.token_ids[start:]
        lps += c.logprobs[start:]
        tops += c.tops[start:] or [[]] * len(c.token_ids[start:])
        strings = [self.token_text(t) for t in tokens]
        offsets = []
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": strings,
            "token_logprobs": lps,
            "top_logprobs": [
                self._tops(p, t, lp) for p, t, lp in zip(tops, tokens, lps, strict=True)
            ],
            "text_offset": offsets,
        }

    def _prefix(self, c: Choice) -> str:
        return self.prompt_texts[c.prompt_index] if self.echo else ""

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.gen.choices:
            lp = self._logprobs(c, 0, self.echo, 0) if self.top is not None else None
            choices.append(
                {
                    "index": c.index,
                    "text": self._prefix(c) + c.text.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
            )
        body = self.envelope(choices, chunk=False)
        body["usage"] = usage(self.gen)
        return body

    def chunk(self, d: ChoiceDelta) -> dict[str, Any] | None:
        c = d.choice
        text = (self._prefix(c) if d.first else "") + d.text
        new_tokens = len(c.token_ids) > d.start or (d.first and self.echo)
        if not text and d.finish_reason is None and not (self.top is not None and new_tokens):
            return None
        lp = None
        if self.top is not None:
            lp = self._logprobs(c, d.start, d.first and self.echo, 0)
        choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}
        return self.envelope([choice], chunk=True)
