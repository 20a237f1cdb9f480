"""One chat choice's answer text, split as it streams into reasoning, content and tool calls."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .reasoning import Mode, ReasoningSplitter
from .tools import ToolCallDelta, ToolCallParser


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass(frozen=True)
class OutputRules:
    """How every choice of one request is parsed."""

    mode: Mode
    tools: Mapping[str, Any] | None  # name -> parameters schema; None: calls are not parsed
    max_calls: int | None = None  # 1 when parallel_tool_calls is false


class ChatOutput:
    def __init__(self, rules: OutputRules) -> None:
        self._split = ReasoningSplitter(rules.mode)
        self._calls = (
            ToolCallParser(rules.tools, rules.max_calls) if rules.tools is not None else None
        )
        self.reasoning = ""
        self.content = ""

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self._calls.calls if self._calls is not None else []

    def feed(self, text: str) -> OutputDelta:
        return self._take(*self._split.feed(text), final=False)

    def finish(self) -> OutputDelta:
        return self._take(*self._split.finish(), final=True)

    def _take(self, reasoning: str, content: str, final: bool) -> OutputDelta:
        delta = OutputDelta(reasoning=reasoning)
        if self._calls is None:
            delta.content = content
        else:
            delta.content, delta.calls = self._calls.feed(content)
            if final:
                more, calls = self._calls.finish()
                delta.content += more
                delta.calls += calls
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta


def parse_whole(text: str, rules: OutputRules) -> ChatOutput:
    """A finished answer, parsed in one go."""
    out = ChatOutput(rules)
    out.feed(text)
    out.finish()
    return out
