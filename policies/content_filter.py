"""Blocked-content rules matched after normalizing away case, Unicode compatibility forms, width,
zero-width characters and spacing tricks ("b a d", "b\u200bad", "ＢＡＤ" all match "bad")."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# format characters used to split words invisibly: zero-width space/joiners, word joiner, BOM, soft hyphen
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e"), None)
_SPACES = re.compile(r"\s+")
_NOT_WORD = re.compile(r"[\W_]+")


def normalize(text: str) -> str:
    """NFKC folds full-width and compatibility forms; casefold handles case beyond ASCII."""
    text = unicodedata.normalize("NFKC", text).translate(_INVISIBLE).casefold()
    return _SPACES.sub(" ", text).strip()


def squeeze(normalized: str) -> str:
    """Drop everything but letters and digits, so spacing and punctuation tricks collapse."""
    return _NOT_WORD.sub("", normalized)


@dataclass(frozen=True)
class BlockMatch:
    rule: str  # the operator's rule as written


class ContentFilter:
    def __init__(self, words: tuple[str, ...] = (), patterns: tuple[str, ...] = ()) -> None:
        self.words = [(w, squeeze(normalize(w))) for w in words if squeeze(normalize(w))]
        self.patterns = [(p, re.compile(p, re.IGNORECASE)) for p in patterns]

    def check(self, text: str) -> BlockMatch | None:
        if not (self.words or self.patterns):
            return None
        normalized = normalize(text)
        squeezed = squeeze(normalized)
        for rule, needle in self.words:
            if needle in squeezed:
                return BlockMatch(rule)
        for rule, pattern in self.patterns:
            if pattern.search(normalized) or pattern.search(squeezed):
                return BlockMatch(rule)
        return None
