"""What a chat request constrains its answer to, as an xgrammar structural-tag spec.

`response_format` json_schema / json_object and `tool_choice` required / named each become a
spec (plain JSON data, so the compiler caches grammars by it). When the prompt leaves the model
inside <think>, the reasoning stays free text and the constraint starts after </think>.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from .errors import APIError
from .markup import CALL_CLOSE, CALL_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN, THINK_CLOSE, THINK_OPEN
from .protocol import ChatCompletionRequest, NamedToolChoice

# Longest run of whitespace allowed between JSON tokens: room for indented output, while a
# model that keeps choosing blanks (tiny-random does) still has to make progress.
MAX_WHITESPACE = 8
OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming `param` unless `schema` is a valid JSON schema."""
    if not isinstance(schema, dict | bool):
        raise APIError(400, "a JSON schema must be an object", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.path)
        raise APIError(
            400, f"invalid JSON schema{f' at {where}' if where else ''}: {err.message}", param
        ) from None


def tool_schemas(body: ChatCompletionRequest) -> dict[str, Any]:
    """Tool name -> its parameters schema, each checked; names must be unique."""
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(body.tools or []):
        name = tool.function.name
        if name in schemas:
            raise APIError(400, f"two tools are named {name!r}", f"tools.{i}.function.name")
        params = tool.function.parameters
        if params is not None:
            check_schema(params, f"tools.{i}.function.parameters")
        schemas[name] = params
    return schemas


def check_tool_choice(body: ChatCompletionRequest, schemas: dict[str, Any]) -> None:
    choice = body.tool_choice
    if choice in ("required",) or isinstance(choice, NamedToolChoice):
        if not schemas:
            raise APIError(400, "tool_choice needs tools to choose from", "tool_choice")
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(
                400,
                "response_format cannot be combined with a forced tool_choice",
                "response_format",
            )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in schemas:
        raise APIError(
            400,
            f"tool_choice names {choice.function.name!r}, which is not among the tools "
            f"({', '.join(sorted(schemas))})",
            "tool_choice",
        )


def _reasoning_prefix() -> dict[str, Any]:
    """Free reasoning text up to </think>, then the blank line the format puts after it."""
    free = {"type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE]}
    return {
        "type": "sequence",
        "elements": [
            {"type": "tag", "begin": "", "content": free, "end": THINK_CLOSE},
            {"type": "const_string", "value": "\n\n"},
        ],
    }


def _spec(fmt: dict[str, Any], reasoning: bool) -> dict[str, Any]:
    if reasoning:
        fmt = {"type": "sequence", "elements": [_reasoning_prefix(), fmt]}
    return {"type": "structural_tag", "format": fmt}


def _plain_strings(schema: Any) -> Any:
    """`schema` with each length-bounded string spelt as a pattern. xgrammar's grammar for
    minLength/maxLength lets raw control characters (a tab) into the string, which JSON
    forbids; the pattern keeps the bounds and excludes them (and escapes)."""
    if isinstance(schema, list):
        return [_plain_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _plain_strings(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if (
        out.get("type") == "string"
        and bounded
        and not {"pattern", "format", "enum", "const"} & set(out)
    ):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return out


def _json(schema: Any, style: str = "json") -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": _plain_strings(schema) if style == "json" else schema,
        "style": style,
        "max_whitespace_cnt": MAX_WHITESPACE,
    }


def _call_tag(name: str, parameters: Any) -> dict[str, Any]:
    """One call in Qwen3.5's XML format, its <parameter> blocks following the schema."""
    return {
        "type": "tag",
        "begin": f"{CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n",
        "content": _json(OBJECT_SCHEMA if parameters is None else parameters, "qwen_xml"),
        "end": f"\n{FUNCTION_CLOSE}\n{CALL_CLOSE}",
    }


def _tools_format(body: ChatCompletionRequest, schemas: dict[str, Any]) -> dict[str, Any]:
    """A named tool: exactly that call. `required`: one call or more (one without
    parallel_tool_calls), one per line, and no text around them."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return _call_tag(choice.function.name, schemas[choice.function.name])
    return {
        "type": "tags_with_separator",
        "tags": [_call_tag(name, params) for name, params in schemas.items()],
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": not body.parallel_tool_calls,
    }


def constraint(
    body: ChatCompletionRequest, schemas: dict[str, Any], reasoning: bool
) -> tuple[dict[str, Any], str] | None:
    """The spec the answer must follow and the request field it comes from, or None when the
    answer is free. `schemas`: from `tool_schemas`; `reasoning`: the prompt ends inside
    <think>. Raises a 400 for a tool_choice or schema that is not valid."""
    check_tool_choice(body, schemas)
    if body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice):
        return _spec(_tools_format(body, schemas), reasoning), "tools"
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _spec(_json(OBJECT_SCHEMA), reasoning), "response_format"
    assert fmt.json_schema is not None and fmt.json_schema.schema_ is not None
    param = "response_format.json_schema.schema"
    check_schema(fmt.json_schema.schema_, param)
    return _spec(_json(fmt.json_schema.schema_), reasoning), param
