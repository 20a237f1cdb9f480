"""Qwen3.5's XML tool calls, parsed from streamed text into OpenAI tool calls.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A call is announced (id and name) as soon as its <function=NAME> line is complete and its
arguments follow once the block closes. Values are typed by the tool's JSON schema: a string
parameter keeps its text (blanks around it dropped), other types are read as JSON
(Python-style True/False/None too, as the chat template writes them).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .markup import CALL_CLOSE, CALL_OPEN, FUNCTION_CLOSE
from .stream import held_back

_HEADER = re.compile(r"\s*<function=([^>\n]+)>\n?")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


@dataclass
class ToolCallDelta:
    """One step of one call: the header (id and name, empty arguments) or its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        return out | {"function": function}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _types(schema: Any) -> list[str]:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if isinstance(schema, Mapping) and "enum" in schema:
        enum = schema["enum"]
        return sorted({"string" if isinstance(v, str) else "json" for v in enum})
    return []


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the value its schema asks for (text when nothing else fits)."""
    kinds = _types(schema)
    text = raw.strip()  # the format puts a newline each side; grammars allow more blanks
    if kinds == ["string"]:
        return text
    if text in _PYTHON_LITERALS and "string" not in kinds:
        return _PYTHON_LITERALS[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return raw


def call_arguments(body: str, parameters: Any) -> dict[str, Any]:
    """The arguments of one <function=...> body, typed by the tool's `parameters` schema."""
    props = parameters.get("properties", {}) if isinstance(parameters, Mapping) else {}
    return {
        key.strip(): typed_value(raw, props.get(key.strip()))
        for key, raw in _PARAMETER.findall(body)
    }


class ToolCallParser:
    """Feeds on answer text, returns (plain content, tool-call deltas)."""

    def __init__(self, schemas: Mapping[str, Any], max_calls: int | None = None) -> None:
        self.schemas = schemas  # tool name -> its parameters schema
        self.max_calls = max_calls
        self.calls: list[dict[str, Any]] = []  # finished calls, OpenAI-shaped
        self._buf = ""
        self._in_call = False
        self._header: tuple[str, str] | None = None  # (id, name) of the open call
        self._blank = ""  # whitespace after a call, dropped if only calls follow

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content, deltas = "", []
        while True:
            if not self._in_call:
                at = self._buf.find(CALL_OPEN)
                if at < 0:
                    keep = held_back(self._buf, [CALL_OPEN])
                    content += self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return content, deltas
                content += self._text(self._buf[:at])
                self._blank = ""
                self._buf, self._in_call = self._buf[at + len(CALL_OPEN) :], True
            if self._header is None:
                head = _HEADER.match(self._buf)
                if head is None:
                    return content, deltas  # the header line is not complete yet
                self._header = (new_call_id(), head.group(1).strip())
                if self._room():
                    call_id, name = self._header
                    deltas.append(ToolCallDelta(len(self.calls), "", call_id, name))
            end = self._buf.find(CALL_CLOSE)
            if end < 0:
                return content, deltas
            deltas += self._close(self._buf[:end])
            self._buf = self._buf[end + len(CALL_CLOSE) :]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The answer ended: an unclosed call that was announced keeps the parameters it
        completed; a bare <tool_call> and anything else left is plain content."""
        rest, self._buf = self._buf, ""
        if self._in_call and self._header is not None:
            return "", self._close(rest)
        if self._in_call:
            return self._text(CALL_OPEN + rest), []
        return self._text(rest), []

    def _room(self) -> bool:
        return self.max_calls is None or len(self.calls) < self.max_calls

    def _close(self, block: str) -> list[ToolCallDelta]:
        assert self._header is not None
        (call_id, name), self._header, self._in_call = self._header, None, False
        if not self._room():
            return []  # parallel_tool_calls false: only the first call counts
        head = _HEADER.match(block)
        body = block[head.end() :] if head else block
        body = body.split(FUNCTION_CLOSE)[0]
        tool = self.schemas.get(name)
        arguments = json.dumps(call_arguments(body, tool), ensure_ascii=False)
        index = len(self.calls)
        self.calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
        return [ToolCallDelta(index, arguments)]

    def _text(self, text: str) -> str:
        """Plain text; once a call was made, blank text is held until real text follows."""
        if not self.calls and self._header is None:
            return text
        if text.strip():
            out, self._blank = self._blank + text, ""
            return out
        self._blank += text
        return ""
