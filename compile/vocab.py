"""The three vocabulary widths behind the padded, pad-masked logits projection."""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 128


class VocabError(ValueError):
    """A tokenizer/checkpoint pairing whose widths cannot be reconciled."""


@dataclass(frozen=True)
class VocabWidths:
    """`rows`: checkpoint embedding rows; `decodable`: ids the tokenizer decodes;
    `selection`: the projected width, a multiple of 128 where the rows allow it."""

    rows: int
    decodable: int
    selection: int

    @classmethod
    def resolve(cls, rows: int, decodable: int, align: int = ALIGN) -> VocabWidths:
        if decodable <= 0:
            raise VocabError(f"decodable width must be positive, got {decodable}")
        if decodable > rows:
            raise VocabError(
                f"the tokenizer decodes {decodable} ids but the checkpoint has only {rows} "
                "embedding rows (vocab_size)"
            )
        selection = min(-(-decodable // align) * align, rows)
        return cls(rows=rows, decodable=decodable, selection=selection)

    def to_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "decodable": self.decodable, "selection": self.selection}
