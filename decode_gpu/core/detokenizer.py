"""Incremental detokenization with stop strings: emit only text that is final.

Text is held back while it ends in an incomplete UTF-8 sequence or could be the start of a stop string.
Each update decodes only a short window of recent tokens (the last committed token range plus the new
ones) and appends the difference, so a long answer costs linear, not quadratic, time.
"""

from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.emitted = 0  # characters already returned
        self.stopped = False
        self.text = ""  # the text of output_tokens[:read_offset], complete characters only
        self.prefix_offset = 0  # decoding restarts here, so a token's text is seen with the one before it
        self.read_offset = 0  # tokens up to here are in self.text

    def update(self, output_tokens: list[int], final: bool = False) -> str:
        """Return the new final text for the full output so far; sets `stopped` when a stop string appears."""
        if self.tokenizer is None or self.stopped:
            return ""
        pending = self._new_text(output_tokens, final)
        text = self.text + pending
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if not final:
            text = text[: self._safe_end(text)]
        return self._emit(text)

    def _new_text(self, tokens: list[int], final: bool) -> str:
        """Text of tokens[read_offset:]; committed to self.text once it ends in a complete character."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(tokens[self.prefix_offset:self.read_offset])
        after = decode(tokens[self.prefix_offset:])
        new = after[len(before):]
        if new.endswith("\ufffd") and not final:
            return new  # an incomplete multi-byte character: shown to _safe_end, not committed
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        return ""

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
