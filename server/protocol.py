"""Request bodies of the OpenAI-compatible routes, validated strictly.

Strict mode keeps "0.5" from passing as a number and `true` as an int; `extra="forbid"`
turns a misspelt field into a 400 instead of a silently ignored setting. A few OpenAI
fields we do not implement are accepted only at their neutral value, so stock clients work.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOPS = 16

TokenId = Annotated[int, Field(ge=0)]
StopText = Annotated[str, Field(min_length=1, max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """Fields shared by both routes."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted so stock clients work; only the neutral value is allowed.
    presence_penalty: Literal[0, 0.0] | None = None
    frequency_penalty: Literal[0, 0.0] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def problem(self) -> tuple[str, str] | None:
        """(field, message) for a combination of fields that is invalid, else None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


PromptIds = Annotated[list[TokenId], Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: (
        PromptText
        | Annotated[list[PromptText], Field(min_length=1, max_length=64)]
        | PromptIds
        | Annotated[list[PromptIds], Field(min_length=1, max_length=64)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def problem(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens must be >= 1 unless echo is true"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported"
        return super().problem()

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class FunctionCall(_Body):
    name: ToolName
    arguments: str  # a JSON object, as text (OpenAI's convention)


class ToolCall(_Body):
    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None  # assistant
    tool_call_id: Annotated[str, Field(min_length=1)] | None = None  # tool
    reasoning_content: str | None = None  # assistant: its <think> part

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def problem(self) -> tuple[str, str] | None:
        """(field under this message, message) when the role's required fields are wrong."""
        if self.role != "assistant" and self.content is None:
            return "content", f"a {self.role} message needs content"
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            return "content", "an assistant message needs content or tool_calls"
        if self.tool_calls is not None and self.role != "assistant":
            return "tool_calls", "only assistant messages carry tool_calls"
        if self.role == "tool" and self.tool_call_id is None:
            return "tool_call_id", "a tool message needs the tool_call_id it answers"
        if self.reasoning_content is not None and self.role != "assistant":
            return "reasoning_content", "only assistant messages carry reasoning_content"
        return None


class FunctionDef(_Body):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def problem(self) -> tuple[str, str] | None:
        if self.max_tokens == 0:
            return "max_tokens", "max_tokens must be >= 1"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        for i, message in enumerate(self.messages):
            found = message.problem()
            if found is not None:
                return f"messages.{i}.{found[0]}", found[1]
        fmt = self.response_format
        if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
            return "response_format", "json_schema goes with, and only with, type json_schema"
        if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is None:
            return "response_format.json_schema.schema", "json_schema needs a schema"
        return super().problem()

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
