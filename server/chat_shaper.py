"""OpenAI chat-completion JSON, whole or as stream chunks: each choice's text split into
reasoning_content, content and tool_calls (finish_reason "tool_calls" when it called any)."""

from __future__ import annotations

from typing import Any

from .chat_output import ChatOutput, OutputDelta, OutputRules, parse_whole
from .formats import Shaper, usage
from .serving import Choice, ChoiceDelta


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChatShaper(Shaper):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, *args: Any, rules: OutputRules, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rules = rules
        self._streams: dict[int, ChatOutput] = {}  # choice index -> its streaming parser

    def _entry(self, token: int, lp: float) -> dict[str, Any]:
        s = self.token_text(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, c: Choice, start: int) -> dict[str, Any]:
        content = []
        for i in range(start, len(c.token_ids)):
            entry = self._entry(c.token_ids[i], c.logprobs[i])
            pairs = c.tops[i] if i < len(c.tops) else []
            entry["top_logprobs"] = [self._entry(t, v) for t, v in pairs]
            content.append(entry)
        return {"content": content}

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.gen.choices:
            out = parse_whole(c.text.text, self.rules)
            calls = out.tool_calls
            message: dict[str, Any] = {
                "role": "assistant",
                "content": out.content.strip() or None if calls else out.content,
                "reasoning_content": out.reasoning or None,
            }
            if calls:
                message["tool_calls"] = calls
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c, 0) if self.top is not None else None,
                    "finish_reason": _finish_reason(c.finish_reason, bool(calls)),
                }
            )
        body = self.envelope(choices, chunk=False)
        body["usage"] = usage(self.gen)
        return body

    def role_chunks(self) -> list[dict[str, Any]]:
        return [
            self.envelope(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                chunk=True,
            )
            for c in self.gen.choices
        ]

    def _parse(self, d: ChoiceDelta) -> tuple[OutputDelta, bool]:
        """What this delta adds to the choice's parts, and whether it has called a tool."""
        stream = self._streams.setdefault(d.choice.index, ChatOutput(self.rules))
        out = stream.feed(d.text)
        if d.finish_reason is not None:
            rest = stream.finish()
            out.reasoning += rest.reasoning
            out.content += rest.content
            out.calls += rest.calls
        return out, bool(stream.tool_calls)

    def chunk(self, d: ChoiceDelta) -> dict[str, Any] | None:
        c = d.choice
        out, called = self._parse(d)
        new_tokens = len(c.token_ids) > d.start
        if not out and d.finish_reason is None and not (self.top is not None and new_tokens):
            return None
        delta: dict[str, Any] = {}
        if out.reasoning:
            delta["reasoning_content"] = out.reasoning
        if out.content or (not out and d.finish_reason is None):
            delta["content"] = out.content
        if out.calls:
            delta["tool_calls"] = [call.openai() for call in out.calls]
        lp = self._logprobs(c, d.start) if self.top is not None else None
        choice = {
            "index": c.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": _finish_reason(d.finish_reason, called),
        }
        return self.envelope([choice], chunk=True)
