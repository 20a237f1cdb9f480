"""Chat for agents through the official openai client against a real uvicorn (CPU,
tiny-random): JSON-schema answers and forced tool calls validate for every seed, streamed and
not, under continuous batching and with n > 1; `parse` with a pydantic model works; bad
schemas, tool choices and tool messages get 400s naming the field. Its weights are random, so
only the grammar makes the structure hold: with the mask switched off, the same check fails."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_agents_format import CONVERSATION, EXPECTED, TOOLS
from test_server_harness import KEY, Served, start_server

from qwen35_tvm.runtime import grammar

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]
SEEDS = range(20)
# Strings carry a maxLength: a random model, free inside a string, would rarely close it.
PET: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "verified": {"type": "boolean"},
            },
            "required": ["city", "verified"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "owner", "tags"],
    "additionalProperties": False,
}
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
LOOKUP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 16}, "top": {"type": "boolean"}},
    "required": ["query", "top"],
}
AGENT_TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": LOOKUP}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
]
SCHEMAS = {"weather": LOOKUP, "search": SEARCH}


@pytest.fixture(scope="module")
def served(tiny_random_artifact):
    with start_server(tiny_random_artifact) as s:
        yield s


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def each_seed(run: Callable[[int], Any]) -> list[Any]:
    """One request per seed, all at once: they share the engine's batches."""
    with ThreadPoolExecutor(max_workers=len(SEEDS)) as pool:
        return list(pool.map(run, SEEDS))


def valid(text: str | None, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def pet(client: openai.OpenAI, seed: int, stream: bool, **extra: Any) -> tuple[str, str | None]:
    """(content, finish_reason) of one sampled json_schema answer."""
    args = {"model": "tiny-random", "messages": ASK, "max_tokens": 400, "temperature": 1.0}
    args |= {"seed": seed, "response_format": PET_FORMAT, "extra_body": NO_THINK} | extra
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        assert getattr(delta, "reasoning_content", None) is None  # thinking is off
        text += delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate_for_20_seeds(served, client, stream):
    before = served.server.grammars.compilations
    answers = each_seed(lambda seed: pet(client, seed, stream))
    bad = [a for a in answers if not valid(a[0], PET) or a[1] != "stop"]
    assert not bad, bad[:3]
    assert len({a[0] for a in answers}) > 10  # sampled: the seeds really differ
    assert served.server.grammars.compilations - before <= 1  # compiled once, then cached
    assert served.idle()


def test_without_the_bitmask_the_json_schema_check_fails(client):
    grammar.set_masking(False)
    try:
        answers = [pet(client, seed, False, max_tokens=60) for seed in range(3)]
    finally:
        grammar.set_masking(True)
    assert not any(valid(text, PET) for text, _ in answers)


def test_n_choices_greedy_and_free_requests_share_batches(client):
    def constrained(seed: int) -> list[str]:
        reply = client.chat.completions.create(
            model="tiny-random",
            messages=ASK,
            max_tokens=400,
            n=3,
            seed=seed,
            response_format=PET_FORMAT,
            extra_body=NO_THINK,
        )
        return [c.message.content or "" for c in reply.choices]

    def free(seed: int) -> str:
        reply = client.chat.completions.create(
            model="tiny-random", messages=ASK, max_tokens=30, seed=seed, extra_body=NO_THINK
        )
        return reply.choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = [pool.submit(constrained, 1), pool.submit(free, 2), pool.submit(constrained, 3)]
        jobs.append(pool.submit(free, 4))
        results = [j.result() for j in jobs]
    texts = results[0] + results[2]
    assert len(texts) == 6 and all(valid(t, PET) for t in texts)
    assert results[1] == results[3] == "length"  # free answers stay free
    # Greedy: the device's argmax ignores the grammar, so a constrained row never takes it.
    greedy = client.chat.completions.create(
        model="tiny-random",
        messages=ASK,
        max_tokens=400,
        temperature=0,
        response_format=PET_FORMAT,
        extra_body=NO_THINK,
    )
    assert valid(greedy.choices[0].message.content, PET)


def test_parse_with_a_pydantic_model(client):
    class Owner(BaseModel):
        city: Annotated[str, Field(max_length=10)]
        verified: bool

    class Pet(BaseModel):
        name: Annotated[str, Field(max_length=12)]
        kind: Literal["cat", "dog", "bird"]
        age: Annotated[int, Field(ge=0, le=30)]
        owner: Owner
        tags: Annotated[list[Literal["a", "b", "c"]], Field(max_length=3)]

    for seed in (0, 1):
        done = client.chat.completions.parse(
            model="tiny-random",
            messages=ASK,
            response_format=Pet,
            max_tokens=400,
            seed=seed,
            extra_body=NO_THINK,
        )
        assert isinstance(done.choices[0].message.parsed, Pet)


def call_args(calls: list[Any]) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_choice_required_and_named_return_valid_tool_calls(client, thinking):
    extra = {} if thinking else NO_THINK
    base = {"model": "tiny-random", "messages": ASK, "tools": AGENT_TOOLS, "max_tokens": 300}
    base |= {"extra_body": extra, "parallel_tool_calls": False}

    def required(seed: int) -> Any:
        return client.chat.completions.create(tool_choice="required", seed=seed, **base)

    def named(seed: int) -> Any:
        choice = {"type": "function", "function": {"name": "search"}}
        return client.chat.completions.create(tool_choice=choice, seed=seed, **base)

    runs = [(required, None), (named, "search")] if not thinking else [(named, "search")]
    for run, name in runs:
        with ThreadPoolExecutor(max_workers=8) as pool:
            replies = list(pool.map(run, range(8 if not thinking else 1)))
        for reply in replies:
            choice = reply.choices[0]
            if thinking and choice.finish_reason == "length":
                # random weights rarely close </think>: the call is only due after it
                assert choice.message.reasoning_content and not choice.message.tool_calls
                continue
            assert choice.finish_reason == "tool_calls", choice
            [(got, args)] = call_args(choice.message.tool_calls)
            assert got == (name or got) and got in SCHEMAS
            jsonschema.validate(args, SCHEMAS[got])
            assert choice.message.tool_calls[0].id.startswith("call_")


def test_tool_calls_stream_as_deltas(client):
    stream = client.chat.completions.create(
        model="tiny-random",
        messages=ASK,
        tools=AGENT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        seed=7,
        stream=True,
        extra_body=NO_THINK,
    )
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert [r for r in reasons if r] == ["tool_calls"]
    [entry] = calls.values()
    assert entry["id"].startswith("call_") and entry["name"] in SCHEMAS
    jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_a_tool_conversation_is_rendered_as_qwen35_expects(served, client):
    reply = client.chat.completions.create(
        model="tiny-random", messages=CONVERSATION, tools=TOOLS, max_tokens=2
    )
    expected = served.tokenizer.encode(EXPECTED + "<think>\n")
    assert reply.usage.prompt_tokens == len(expected)


MSG = [{"role": "user", "content": "hi"}]
BAD_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", **schema}}}


def tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": function}


ERRORS: list[tuple[dict[str, Any], str]] = [
    (schema_format({"schema": {"type": "nonsense"}}), "response_format.json_schema.schema"),
    (
        schema_format({"schema": {"properties": {"a": {"minLength": "x"}}}}),
        "response_format.json_schema.schema",
    ),
    (schema_format({}), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": AGENT_TOOLS, "tool_choice": tool(name="nope")}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": AGENT_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [tool(name="f", parameters={"type": 5})]}, "tools.0.function.parameters"),
    ({"tools": [AGENT_TOOLS[0], AGENT_TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": [tool(name="bad name")]}, "tools.0.function.name"),
    (
        {"messages": [*MSG, {"role": "tool", "tool_call_id": "x", "content": "1"}]},
        "messages.1.tool_call_id",
    ),
    ({"messages": [*MSG, {"role": "tool", "content": "1"}]}, "messages.1.tool_call_id"),
    ({"messages": [*MSG, {"role": "assistant"}]}, "messages.1.content"),
    (
        {"messages": [*MSG, {"role": "assistant", "tool_calls": [BAD_CALL]}]},
        "messages.1.tool_calls.0.function.arguments",
    ),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": [{"role": "system", "content": "only a system turn"}]}, "messages"),
]


def test_bad_agent_requests_get_400_naming_the_field(served):
    failures = []
    for extra, param in ERRORS:
        body = {"messages": MSG, "max_tokens": 2, **extra}
        r = httpx.post(
            served.url + "/v1/chat/completions", json=body, headers=served.headers(), timeout=60
        )
        err = r.json().get("error", {})
        if r.status_code != 400 or err.get("param") != param or not err.get("message"):
            failures.append((extra, r.status_code, r.text[:200]))
    assert not failures, "\n".join(map(str, failures))
    assert served.idle()
