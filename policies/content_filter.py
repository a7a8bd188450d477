"""Blocked-content rules matched after normalizing away case, Unicode compatibility forms, width,
zero-width characters and spacing tricks ("b a d", "b\u200bad", "ＢＡＤ", "b.a.d" all match "bad").

Both kinds of rule run on the event loop over up to a whole request body (1 MiB), so both run in RE2,
whose time is linear in the text whatever the rule: an operator's pattern cannot backtrack for minutes."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import re2

# format characters used to split words invisibly: zero-width space/joiners, word joiner, BOM, soft hyphen
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e"), None)
_SPACES = re.compile(r"\s+")
_NOT_WORD = re.compile(r"[\W_]+")
# RE2's lazily built DFA slows down sharply once one program holds thousands of words; a few hundred
# per program keeps each scan at a few milliseconds per MiB
_WORDS_PER_PROGRAM = 256


def _options(case_sensitive: bool) -> re2.Options:
    options = re2.Options()
    options.case_sensitive = case_sensitive
    options.log_errors = False  # a refused pattern is reported to the operator with its line, not on stderr
    return options


_PATTERN_OPTIONS = _options(case_sensitive=False)
_WORD_OPTIONS = _options(case_sensitive=True)  # words and text are both case-folded already


def normalize(text: str) -> str:
    """NFKC folds full-width and compatibility forms; casefold handles case beyond ASCII."""
    text = unicodedata.normalize("NFKC", text).translate(_INVISIBLE).casefold()
    return _SPACES.sub(" ", text).strip()


def squeeze(normalized: str) -> str:
    """Drop everything but letters and digits, so spacing and punctuation tricks collapse."""
    return _NOT_WORD.sub("", normalized)


def tokens(normalized: str) -> str:
    """The words (runs of letters and digits) of the text, one space between each and one at each end."""
    return f" {_NOT_WORD.sub(' ', normalized).strip()} "


def compile_pattern(pattern: str) -> re2._Regexp:
    """Raises re2.error for what RE2 cannot run: bad syntax, backreferences, lookaround."""
    return re2.compile(pattern, _PATTERN_OPTIONS)


def pattern_error(pattern: str) -> str | None:
    """Why RE2 refuses the pattern, in words; None when it compiles."""
    try:
        compile_pattern(pattern)
    except re2.error as err:  # the binding passes RE2's message on as bytes
        reason = err.args[0] if err.args else "rejected"
        return reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)
    return None


def _word_program(needles: list[str]) -> re2._Regexp:
    """One RE2 program finding any needle as a run of whole consecutive tokens: a space may come between
    any two of its characters (the run may be split anywhere), and it must begin and end at a space (so
    "ass" is not found in "class" or "bass", but is in "a s s")."""
    spelled = (" ?".join(re.escape(char) for char in needle) for needle in needles)
    return re2.compile(f" (?:{'|'.join(spelled)}) ", _WORD_OPTIONS)


@dataclass(frozen=True)
class BlockMatch:
    rule: str  # the operator's rule as written


class ContentFilter:
    def __init__(self, words: tuple[str, ...] = (), patterns: tuple[str, ...] = ()) -> None:
        self.rule_of: dict[str, str] = {}  # normalized word (letters and digits only) -> the rule as written
        for word in words:
            self.rule_of.setdefault(squeeze(normalize(word)), word)
        self.rule_of.pop("", None)  # a rule with no letters or digits would match every text
        needles = list(self.rule_of)
        self.word_programs = [_word_program(needles[i:i + _WORDS_PER_PROGRAM])
                              for i in range(0, len(needles), _WORDS_PER_PROGRAM)]
        self.patterns = [(p, compile_pattern(p)) for p in patterns]

    def check(self, text: str) -> BlockMatch | None:
        if not (self.word_programs or self.patterns):
            return None
        normalized = normalize(text)
        return self._word_match(tokens(normalized)) or self._pattern_match(normalized)

    def _word_match(self, spaced: str) -> BlockMatch | None:
        for program in self.word_programs:
            if found := program.search(spaced):
                return BlockMatch(self.rule_of[found.group(0).replace(" ", "")])
        return None

    def _pattern_match(self, normalized: str) -> BlockMatch | None:
        squeezed = squeeze(normalized)
        for rule, pattern in self.patterns:
            if pattern.search(normalized) or pattern.search(squeezed):
                return BlockMatch(rule)
        return None
