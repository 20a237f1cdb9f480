"""A chat request's conversation as prompt text: the checkpoint's own chat template when its
folder carries one, else a built-in template that writes Qwen3.5's published format.

The format (written here from how the model was trained, not copied): tools are listed as JSON
lines in a <tools> block at the top of the system message, followed by the XML call format;
assistant tool calls are <tool_call><function=NAME><parameter=KEY>VALUE</parameter>... blocks;
tool results go back inside a user turn as <tool_response> blocks (consecutive ones share the
turn); reasoning after the last real user query is kept as a <think> block, earlier reasoning
is dropped; the generation prompt opens <think> (or an empty block with enable_thinking false).
"""

from __future__ import annotations

import json
from typing import Any

from qwen35_tvm.runtime.tokenizer import EOS_TOKENS, _template_env

from .errors import APIError
from .protocol import ChatCompletionRequest

_CALL_FORMAT = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
    "Reminder:\n- Function calls MUST follow the specified format: an inner <function=...>"
    "</function> block must be nested within <tool_call></tool_call> XML tags\n- Required "
    "parameters MUST be specified\n- You may provide optional reasoning for your function call "
    "in natural language BEFORE the function call, but NOT after\n- If there is no function "
    "call available, answer the question like normal with your current knowledge and do not "
    "tell the user about function calls\n</IMPORTANT>"
)

BUILTIN_TEMPLATE = (
    """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- set text = (m.content or '')|trim %}
    {%- if m.role == 'user' and not (text.startswith('<tool_response>')
        and text.endswith('</tool_response>')) %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if ns.last_query < 0 %}{{ raise_exception('No user query found in messages.') }}{% endif %}
{%- set first_system = messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n"""
    """<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool|tojson }}{%- endfor %}
    {{- '\\n</tools>' + call_format }}
    {%- if first_system and messages[0].content|trim %}
        {{- '\\n\\n' + messages[0].content|trim }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif first_system %}
    {{- '<|im_start|>system\\n' + messages[0].content|trim + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- set content = (m.content or '')|trim %}
    {%- if m.role == 'system' %}
        {%- if not loop.first %}{{ raise_exception('System message must be first.') }}{% endif %}
    {%- elif m.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1]|trim %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query %}
            {{- '<think>\\n' + reasoning|trim + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in m.tool_calls or [] %}
            {%- if not loop.first %}{{- '\\n' }}{%- elif content %}{{- '\\n\\n' }}{%- endif %}
            {{- '<tool_call>\\n<function=' + call.function.name + '>\\n' }}
            {%- for key, value in call.function.arguments.items() %}
                {{- '<parameter=' + key + '>\\n' }}
                {%- if value is mapping or (value is iterable and value is not string) %}
                    {{- value|tojson }}
                {%- else %}
                    {{- value|string }}
                {%- endif %}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""
)

_RESERVED = ("messages", "tools", "add_generation_prompt")


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it (tool-call arguments as dicts); a tool
    message must answer a call made earlier in the conversation."""
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, m in enumerate(body.messages):
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        if m.reasoning_content is not None:
            entry["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            entry["tool_calls"] = [
                _template_call(call, f"messages.{i}.tool_calls.{j}.function.arguments")
                for j, call in enumerate(m.tool_calls)
            ]
            call_ids.update(call.id for call in m.tool_calls)
        if m.role == "tool":
            if m.tool_call_id not in call_ids:
                raise APIError(
                    400,
                    f"tool message {i} answers tool_call_id {m.tool_call_id!r}, which no "
                    "earlier assistant message called",
                    f"messages.{i}.tool_call_id",
                )
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def _template_call(call: Any, param: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as err:
        raise APIError(400, f"tool-call arguments are not valid JSON: {err}", param) from None
    if not isinstance(arguments, dict):
        raise APIError(400, "tool-call arguments must be a JSON object", param)
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


class ChatRenderer:
    """Renders chat requests with one compiled template (the checkpoint's or the built-in)."""

    def __init__(self, checkpoint_template: str | None) -> None:
        self.builtin = checkpoint_template is None
        env = _template_env()
        env.globals["call_format"] = _CALL_FORMAT
        self._template = env.from_string(checkpoint_template or BUILTIN_TEMPLATE)

    def render(self, body: ChatCompletionRequest) -> str:
        """The prompt text; a conversation the template refuses is a 400 naming `messages`."""
        extra = dict(body.chat_template_kwargs or {})
        clash = [k for k in extra if k in _RESERVED]
        if clash:
            raise APIError(
                400, f"chat_template_kwargs may not set {clash[0]!r}", "chat_template_kwargs"
            )
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        if body.tool_choice == "none":
            tools = []  # the model is not told about tools it may not call
        return self.render_messages(template_messages(body), tools, **extra)

    def render_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **extra: Any
    ) -> str:
        context: dict[str, Any] = {"eos_token": EOS_TOKENS[0], **extra}
        context |= {"messages": messages, "tools": tools or None, "add_generation_prompt": True}
        try:
            return self._template.render(**context)
        except Exception as err:  # a template error is the conversation's fault (no user turn)
            raise APIError(400, f"cannot format the conversation: {err}", "messages") from None
