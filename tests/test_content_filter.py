"""Blocked content is caught through case, Unicode width/compatibility forms, zero-width characters and spacing."""

import pytest

from policies.content_filter import ContentFilter

RULES = ContentFilter(words=("forbidden", "secret plan"), patterns=(r"credit\s*card\s*\d{4}",))


def variants(word: str) -> list[str]:
    fullwidth = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in word)
    return [
        word, word.upper(), word.title(), "".join(c.upper() if i % 2 else c for i, c in enumerate(word)),
        fullwidth, "\u200b".join(word), "\u200d".join(word), "\u2060".join(word), "\u00ad".join(word),
        " ".join(word), "-".join(word), f"xx {word} yy", "\ufeff" + word,
    ]


@pytest.mark.parametrize("word", ["forbidden", "secret plan"])
def test_every_obfuscation_of_a_word_rule_is_caught(word):
    for text in variants(word):
        assert RULES.check(f"please say {text} now") is not None, repr(text)


def test_obfuscated_pattern_rule_is_caught():
    for text in ["credit card 1234", "CREDIT CARD 1234", "ｃｒｅｄｉｔ ｃａｒｄ １２３４", "credit\u200bcard 1234",
                 "c r e d i t  c a r d 1 2 3 4"]:
        assert RULES.check(text) is not None, repr(text)


def test_innocent_text_passes():
    for text in ["the forest is bidden to grow", "a secretary planned it", "credit is good", ""]:
        assert RULES.check(text) is None, text


def test_no_rules_means_nothing_is_blocked():
    assert ContentFilter().check("forbidden") is None
