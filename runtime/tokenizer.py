"""Text <-> token ids for the runtime: encoding, decoding, chat formatting and streaming.

Depends only on `tokenizers`, `jinja2` and the standard library, so an artifact folder
(`tokenizer.json`, optional `chat_template.jinja`) is all the runtime needs.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, normalizers

EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
CHAT_ROLES = ("system", "user", "assistant")
_REPLACEMENT = "\ufffd"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_env() -> ImmutableSandboxedEnvironment:
    """A sandbox configured like transformers' chat-template environment, so HF templates
    render the same way here; the sandbox keeps untrusted templates off Python internals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        extensions=[jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check chat messages and return plain-dict copies (templates may not mutate ours)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    checked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"message {i} has role {role!r}; expected one of {CHAT_ROLES}")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message {i} content must be a string, got {type(content).__name__}")
        checked.append(dict(message))
    return checked


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the chat template that goes with it."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        # Python's NFC tracks a newer Unicode than the Rust normalizer (e.g. the NKo
        # combining marks' canonical order); pre-normalising matches the reference encoder.
        self._python_nfc = isinstance(tokenizer.normalizer, normalizers.NFC)
        self.eos_token_ids: tuple[int, ...] = tuple(
            tid for tid in (tokenizer.token_to_id(t) for t in EOS_TOKENS) if tid is not None
        )

    @classmethod
    def from_dir(cls, artifact_dir: str | Path) -> TextTokenizer:
        """Load `tokenizer.json` and, when present, `chat_template.jinja` from a folder."""
        folder = Path(artifact_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(Tokenizer.from_file(str(path)), template)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids for `text`; special-token strings in it (`<|im_start|>`) become their ids.
        `add_special` asks the post-processor for BOS/EOS (Qwen's adds none)."""
        if self._python_nfc:
            text = unicodedata.normalize("NFC", text)
        return self.tokenizer.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> str:
        """The prompt text for a conversation: the carried template rendered in a sandbox,
        else plain Qwen ChatML. `template_vars` (e.g. `enable_thinking=False`) go to the
        template only."""
        checked = validate_messages(messages)
        if self.chat_template is None:
            parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in checked]
            if add_generation_prompt:
                parts.append("<|im_start|>assistant\n")
            return "".join(parts)
        if self._template is None:
            self._template = _template_env().from_string(self.chat_template)
        context: dict[str, Any] = {"eos_token": EOS_TOKENS[0], "tools": None}
        context.update(template_vars)
        context["messages"] = checked
        context["add_generation_prompt"] = add_generation_prompt
        return self._template.render(**context)

    def detokenizer(self, skip_special: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special=skip_special)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without splitting a character.

    Byte-level tokens can end mid-way through a UTF-8 character, which decodes to U+FFFD;
    such a tail is held back until later tokens complete it (or `flush()` gives up).
    Only a short window of ids is re-decoded per token: from the start of the previously
    emitted chunk (`_prefix`) to the end, compared with what was already emitted of it.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, start: int, stop: int) -> str:
        return self._tok.decode(self._ids[start:stop], skip_special=self._skip_special)

    def feed(self, token_id: int) -> str:
        """Add one token id; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """Everything still held back, even an incomplete character (as U+FFFD)."""
        emitted = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return text[len(emitted) :]
