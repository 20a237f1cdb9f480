"""Qwen3.5's chat markup: the tags its output is parsed by, and a tokenizer that shows them.

The tags are single added tokens. Some tokenizer files mark them special, so a detokenizer
that skips special tokens (as every answer's does) would silently drop them; the chat route
decodes with a copy on which only the markup tokens are made ordinary.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from qwen35_tvm.runtime.grammar import MARKUP_TOKENS
from qwen35_tvm.runtime.tokenizer import TextTokenizer

THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = MARKUP_TOKENS
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"


def reveal_markup(tokenizer: TextTokenizer) -> TextTokenizer:
    """A copy of `tokenizer` whose markup tokens decode as text even when skipping specials."""
    spec = json.loads(tokenizer.tokenizer.to_str())
    for added in spec.get("added_tokens", []):
        if added["content"] in MARKUP_TOKENS:
            added["special"] = False
    return TextTokenizer(Tokenizer.from_str(json.dumps(spec)), tokenizer.chat_template)
