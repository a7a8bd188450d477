"""Incremental detokenization with stop strings: emit only text that is final.

Text is held back while it ends in an incomplete UTF-8 sequence or could be the start of a stop string.
"""

from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.emitted = 0  # characters already returned
        self.stopped = False

    def update(self, output_tokens: list[int], final: bool = False) -> str:
        """Return the new final text for the full output so far; sets `stopped` when a stop string appears."""
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.decode(output_tokens, skip_special_tokens=True)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if not final:
            text = text[: self._safe_end(text)]
        return self._emit(text)

    def _emit(self, text: str) -> str:
        new = text[self.emitted:]
        self.emitted = max(self.emitted, len(text))
        return new

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self, text: str) -> int:
        end = len(text)
        while end > self.emitted and text[end - 1] == "\ufffd":  # an incomplete multi-byte character
            end -= 1
        hold = 0
        for stop in self.stop:  # a suffix that may grow into a stop string
            for k in range(min(len(stop) - 1, end - self.emitted), hold, -1):
                if text[end - k:end] == stop[:k]:
                    hold = k
                    break
        return end - hold
