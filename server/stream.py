"""Token ids to text deltas for one choice: whole characters only, stop strings cut out.

Text that could still turn out to be the start of a stop string is held back, so a stop
string split over several tokens is matched and never partly sent to the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from qwen35_tvm.runtime.tokenizer import TextTokenizer


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, stops: Sequence[str]) -> None:
        self._detok = tokenizer.detokenizer(skip_special=True)
        self._stops = [s for s in stops if s]
        self._pending = ""  # decoded but not yet emitted
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found; nothing more will be emitted

    def feed(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to send (possibly empty)."""
        if self.stopped:
            return ""
        return self._push(self._detok.feed(token_id), final=False)

    def finish(self) -> str:
        """The generation ended: everything still held back, minus any stop string."""
        if self.stopped:
            return ""
        return self._push(self._detok.flush(), final=True)

    def _push(self, new: str, final: bool) -> str:
        buf = self._pending + new
        cut = self._first_stop(buf)
        if cut is not None:
            self.stopped = True
            out, self._pending = buf[:cut], ""
        else:
            keep = 0 if final else held_back(buf, self._stops)
            out, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out

    def _first_stop(self, buf: str) -> int | None:
        # Emitted text never ends in a stop string's prefix, so a match lies wholly in buf.
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None
