"""Chat for agents without a server: the built-in template writes Qwen3.5's published prompt
format for tools, tool results and thinking; answers split into reasoning, content and typed
tool calls however the text is chunked; the grammar mask never touches pad columns."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qwen35_tvm.server.chat_output import ChatOutput, OutputRules, parse_whole
from qwen35_tvm.server.chat_template import _CALL_FORMAT, ChatRenderer, template_messages
from qwen35_tvm.server.errors import APIError
from qwen35_tvm.server.protocol import ChatCompletionRequest
from qwen35_tvm.server.reasoning import Mode, prompt_mode

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25C"},
    {"role": "assistant", "content": "Paris 21C, Rome 25C."},
    {"role": "user", "content": "And Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "One more call.",
        "tool_calls": [
            {
                "id": "call_3",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_3", "content": "3C"},
]
TOOL_LINE = json.dumps(TOOLS[0], ensure_ascii=False)
# Reasoning before the last real user query is dropped; after it, it is kept as <think>.
EXPECTED = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    + TOOL_LINE
    + "\n</tools>"
    + _CALL_FORMAT
    + "\n\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    "<|im_start|>assistant\nChecking.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n"
    "<tool_response>\n25C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nParis 21C, Rome 25C.<|im_end|>\n"
    "<|im_start|>user\nAnd Oslo?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nOne more call.\n</think>\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n3C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": CONVERSATION, **fields})


def test_multi_turn_tool_conversation_renders_to_qwen35_prompt_text():
    renderer = ChatRenderer(None)
    assert renderer.render(request(tools=TOOLS)) == EXPECTED + "<think>\n"
    off = request(tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert renderer.render(off) == EXPECTED + "<think>\n\n</think>\n\n"
    assert prompt_mode(EXPECTED + "<think>\n") is Mode.REASONING
    assert prompt_mode(EXPECTED + "<think>\n\n</think>\n\n") is Mode.CONTENT
    assert prompt_mode("<|im_start|>assistant\n") is Mode.START
    # A checkpoint's own template is used as it is, with the same messages and tools.
    own = ChatRenderer("{{ messages|length }}|{{ tools[0].function.name }}|{{ x }}")
    assert own.render(request(tools=TOOLS, chat_template_kwargs={"x": 7})) == "9|get_weather|7"


def test_tool_messages_must_answer_an_earlier_call():
    bad = [*CONVERSATION[:3], {"role": "tool", "tool_call_id": "call_9", "content": "x"}]
    with pytest.raises(APIError) as err:
        template_messages(ChatCompletionRequest.model_validate({"messages": bad}))
    assert err.value.status == 400 and err.value.param == "messages.3.tool_call_id"
    broken = json.loads(json.dumps(CONVERSATION[:3]))
    broken[2]["tool_calls"][1]["function"]["arguments"] = "{nope"
    with pytest.raises(APIError) as err:
        template_messages(ChatCompletionRequest.model_validate({"messages": broken}))
    assert err.value.param == "messages.2.tool_calls.1.function.arguments"


ANSWER = (
    "The user wants weather.</think>\n\nLet me look.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
    "</function>\n</tool_call>"
)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_streamed_parts_match_the_whole_answer_however_it_is_chunked(size: int):
    rules = OutputRules(Mode.REASONING, {"get_weather": WEATHER})
    whole = parse_whole(ANSWER, rules)
    assert whole.reasoning == "The user wants weather."
    assert whole.content == "Let me look.\n\n"
    args = [json.loads(c["function"]["arguments"]) for c in whole.tool_calls]
    assert args == [{"city": "New York", "days": 3}, {"city": "42"}]  # typed by the schema
    stream = ChatOutput(rules)
    reasoning = content = ""
    calls: dict[int, dict] = {}
    pieces = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        reasoning += delta.reasoning
        content += delta.content
        for call in delta.calls:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = call.name or entry["name"]
            entry["arguments"] += call.arguments
        assert "<" not in delta.reasoning and "</" not in delta.content  # no tag leaks
    assert (reasoning, content) == (whole.reasoning, whole.content)
    got = [json.loads(calls[i]["arguments"]) for i in sorted(calls)]
    assert got == args and {c["name"] for c in calls.values()} == {"get_weather"}


def test_known_failure_cases():
    tools = {"get_weather": WEATHER}
    # <tool_call> opened inside <think> without </think>: it ends the reasoning.
    inside = parse_whole(
        "hmm <tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>",
        OutputRules(Mode.REASONING, tools),
    )
    assert inside.reasoning == "hmm " and inside.content == ""
    assert json.loads(inside.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    # enable_thinking false: nothing is reasoning, even a <think> the model writes.
    off = parse_whole("<think>x</think>hi", OutputRules(Mode.CONTENT, None))
    assert (off.reasoning, off.content) == ("", "<think>x</think>hi")
    # a model that opens <think> itself (a template without the opener)
    own = parse_whole("<think>\nplan</think>\n\nhi", OutputRules(Mode.START, None))
    assert (own.reasoning, own.content) == ("\nplan", "hi")
    # a bare, never-completed <tool_call> is given back as text; an announced call whose
    # block was cut off keeps the parameters it finished
    assert (
        parse_whole("a <tool_call> b", OutputRules(Mode.CONTENT, tools)).content
        == "a <tool_call> b"
    )
    cut = parse_whole(
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n<parameter=ci",
        OutputRules(Mode.CONTENT, tools),
    )
    assert json.loads(cut.tool_calls[0]["function"]["arguments"]) == {"days": 4}
    # parallel_tool_calls false: the first call only
    two = ANSWER.split("</think>")[1]
    assert len(parse_whole(two, OutputRules(Mode.CONTENT, tools, max_calls=1)).tool_calls) == 1


def test_mask_covers_decodable_columns_only(tiny_random_artifact):
    from tokenizers import Tokenizer

    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.grammar import GrammarCompiler

    widths = Artifact(tiny_random_artifact).widths
    tok = Tokenizer.from_file(str(tiny_random_artifact / "tokenizer.json"))
    compiler = GrammarCompiler(tok, widths.decodable, [248046])
    spec = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": WEATHER}}
    grammar = compiler.compile(spec)
    assert compiler.compile(json.loads(json.dumps(spec))) is grammar  # cached by spec
    assert compiler.compilations == 1
    row = np.zeros(widths.selection, dtype=np.float32)
    row[widths.decodable :] = -np.inf
    state = compiler.state(grammar)
    state.mask(row)
    allowed = np.flatnonzero(np.isfinite(row))
    assert 0 < len(allowed) < 1000 and allowed.max() < widths.decodable
    assert tok.decode([int(allowed[0])]).lstrip().startswith("{")
    assert np.all(np.isneginf(row[widths.decodable :]))  # pad columns stay -inf
    with pytest.raises(ValueError):
        compiler.compile({"type": "structural_tag", "format": {"type": "nonsense"}})


@pytest.mark.parametrize(
    ("fields", "good", "bad"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": WEATHER},
                }
            },
            'plan</think>\n\n{"city": "Oslo", "days": 2}',
            'plan</think>\n\n{"days": 2}',  # city is required
        ),
        (
            {"response_format": {"type": "json_object"}},
            'plan</think>\n\n{"any": [1, {"x": null}]}',
            "plan</think>\n\n[1, 2]",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required"},
            "plan</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
            "</parameter>\n</function>\n</tool_call>",
            "plan</think>\n\nSure! <tool_call>",  # required: no text around the calls
        ),
    ],
)
def test_constraints_accept_well_formed_answers_after_free_reasoning(
    tiny_random_artifact, fields, good, bad
):
    from qwen35_tvm.runtime.grammar import GrammarCompiler
    from qwen35_tvm.runtime.tokenizer import TextTokenizer
    from qwen35_tvm.server.markup import reveal_markup
    from qwen35_tvm.server.structured import constraint, tool_schemas

    tok = reveal_markup(TextTokenizer.from_dir(tiny_random_artifact))
    meta = json.loads((tiny_random_artifact / "artifact.json").read_text())
    compiler = GrammarCompiler(tok.tokenizer, meta["vocab"]["decodable"], [248046])
    body = ChatCompletionRequest.model_validate({"messages": CONVERSATION[:2], **fields})
    spec, _ = constraint(body, tool_schemas(body), reasoning=True)
    grammar = compiler.compile(spec)
    for text, accepted in ((good, True), (bad, False)):
        state = compiler.state(grammar)
        for token in tok.encode(text):
            state.accept(token)
        state.accept(248046)  # <|im_end|>: only allowed once the answer is complete
        assert state.broken is not accepted, text
