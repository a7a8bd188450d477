"""Blocked content is caught through case, Unicode width/compatibility forms, zero-width characters and spacing,
on word boundaries (a blocked word inside a longer word is not a match), in time linear in the text (RE2)."""

import pytest
import re2

from policies.content_filter import BlockMatch, ContentFilter

RULES = ContentFilter(words=("forbidden", "secret plan"), patterns=(r"credit\s*card\s*\d{4}",))


def variants(word: str) -> list[str]:
    fullwidth = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in word)
    return [
        word, word.upper(), word.title(), "".join(c.upper() if i % 2 else c for i, c in enumerate(word)),
        fullwidth, "\u200b".join(word), "\u200d".join(word), "\u2060".join(word), "\u00ad".join(word),
        " ".join(word), "-".join(word), ".".join(word), f"xx {word} yy", "\ufeff" + word, f"({word})!",
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


def test_a_word_inside_a_longer_word_is_not_a_match():
    rules = ContentFilter(words=("ass",))
    for text in ["class", "assignment", "bass", "a classy bassist passed", "Pass the ASSESSMENT"]:
        assert rules.check(text) is None, text
    for text in ["ass", "kick ASS!", "a s s", "a.s.s", "ａｓｓ", "a\u200bss", "(ass)"]:
        assert rules.check(text) == BlockMatch("ass"), text


def test_a_phrase_matches_whole_words_only():
    for text in ["the SECRET plan", "secret-plan", "secret\u200bplan", "s e c r e t p l a n"]:
        assert RULES.check(text) == BlockMatch("secret plan"), text
    for text in ["the secret planet", "top secret planning", "asecret plan", "secretplans"]:
        assert RULES.check(text) is None, text


def test_many_word_rules_each_match_exactly():
    """More words than one RE2 program holds: each is still found, and none as part of a longer word."""
    rules = ContentFilter(words=tuple(f"W{i}rd" for i in range(1000)))
    assert rules.check("say w999rd now") == BlockMatch("W999rd")
    assert rules.check("say w0 rd now") == BlockMatch("W0rd")
    assert rules.check("say w999rds or xw0rd") is None


def test_a_mebibyte_of_text_is_checked_correctly():
    rules = ContentFilter(words=("ass", "forbidden"), patterns=(r"credit\s*card\s*\d{4}",))
    innocent = ("a classy bassist's assignment: credit card " * 30000)[:1 << 20]
    assert len(innocent) == 1 << 20
    assert rules.check(innocent) is None
    assert rules.check(innocent[:-30] + " f.o.r.b.i.d.d.e.n") == BlockMatch("forbidden")
    assert rules.check("x" + innocent[:-30] + "credit card 0000") == BlockMatch(r"credit\s*card\s*\d{4}")


@pytest.mark.parametrize("pattern", [r"(a)\1", r"x(?=y)", r"(?<!x)y"])
def test_patterns_re2_cannot_run_in_linear_time_are_refused(pattern):
    with pytest.raises(re2.error):
        ContentFilter(patterns=(pattern,))
