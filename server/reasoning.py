"""Splits a streamed answer into its <think> part (reasoning_content) and the rest.

Tags may arrive split over several chunks, so text that could be the start of a tag is held
back until it is decided. Qwen3.5 sometimes opens <tool_call> inside <think> and never closes
the think block; the call then ends the reasoning instead of being swallowed by it.
"""

from __future__ import annotations

import enum

from .markup import CALL_OPEN, THINK_CLOSE, THINK_OPEN
from .stream import held_back

_REASONING_ENDS = (THINK_CLOSE, CALL_OPEN)


class Mode(enum.Enum):
    REASONING = "reasoning"  # the prompt opened <think>: the answer starts inside it
    START = "start"  # the model may open <think> itself as its very first output
    CONTENT = "content"  # no reasoning at all (enable_thinking false, or it has ended)


def prompt_mode(prompt_text: str) -> Mode:
    """Where the answer starts, from how the rendered prompt ends."""
    tail = prompt_text.rstrip(" \n")
    if tail.endswith(THINK_OPEN):
        return Mode.REASONING
    if tail.endswith(THINK_CLOSE):  # an empty think block: thinking is switched off
        return Mode.CONTENT
    return Mode.START


class ReasoningSplitter:
    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self._buf = ""
        self._content_started = False  # leading blank lines after </think> are dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that are now certain."""
        self._buf += text
        reasoning = content = ""
        if self.mode is Mode.START:
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.mode, self._buf = Mode.REASONING, head[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(head):
                return "", ""  # undecided: maybe the start of <think>
            else:
                self.mode = Mode.CONTENT
        if self.mode is Mode.REASONING:
            cuts = [(i, tag) for tag in _REASONING_ENDS if (i := self._buf.find(tag)) >= 0]
            if not cuts:
                keep = held_back(self._buf, _REASONING_ENDS)
                reasoning = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning, ""
            at, tag = min(cuts)
            reasoning = self._buf[:at]
            # </think> is dropped; an unclosed <tool_call> stays for the tool-call parser.
            self._buf = self._buf[at + len(tag) :] if tag == THINK_CLOSE else self._buf[at:]
            self.mode = Mode.CONTENT
        content, self._buf = self._buf, ""
        if not self._content_started:
            content = content.lstrip()
            self._content_started = bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Whatever is still held back, as what it was part of."""
        rest, self._buf = self._buf, ""
        if self.mode is Mode.REASONING:
            return rest, ""
        return "", rest if self._content_started else rest.lstrip()
