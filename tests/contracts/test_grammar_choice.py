"""Issue 48: a choice constraint of thousands of strings. As a rule of alternatives each string was an item of the
parser's first row, and past llguidance's max_items_in_row (2,000) the matcher erred on the first token (a 500
decode_failed: "the first token 83 does not fit the constraint"); as one terminal the strings are one lexeme.
Checked over the embedded model's vocabulary, as the prefill worker masks the first token and the engine takes it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from contracts.grammar import build_grammar, matcher_of
from edge.chat.tool_formats import ChatFormat
from edge.chat.tools import answer_constraint, parse_tools

NUM_CHOICES = 5000


@pytest.fixture(scope="module")
def vocabulary(embedded_model_path):
    from prefill_cpu.grammar import GGUFVocabulary
    return GGUFVocabulary(embedded_model_path)


def choices(n: int) -> list[str]:
    """n distinct strings, most sharing their first token with many others (as "choice 1" ... "choice 4999" do)."""
    rng = random.Random(48)
    words = ["choice", "The answer is", "Paris", "yes", "no", "x"]
    return [f"{rng.choice(words)} {i}" for i in range(n)]


def tokens(vocabulary, text: str) -> list[int]:
    return vocabulary._llm.tokenize(text.encode(), add_bos=False, special=False)


def allowed(vocabulary, matcher) -> set[int]:
    mask = np.zeros((vocabulary.tokenizer.vocab_size + 31) // 32, dtype=np.int32)  # [words]
    matcher.fill_bitmask(mask.ctypes.data, mask.nbytes)
    return set(np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0].tolist())


def write(vocabulary, grammar: str, text: str, only_the_end: bool = True) -> None:
    """Each token of text is in the mask and taken, as the prefill worker then the engine do; then the end (only the
    end, unless text is a prefix of another string)."""
    matcher = matcher_of(vocabulary.tokenizer, "choice", grammar, vocabulary.stop_token_ids)
    for token in tokens(vocabulary, text):
        assert token in allowed(vocabulary, matcher), (text, token)
        assert matcher.accept_token(token), matcher.error
    after = allowed(vocabulary, matcher)
    assert set(vocabulary.stop_token_ids) <= after and (after <= set(vocabulary.stop_token_ids) or not only_the_end)
    assert matcher.accept_token(vocabulary.stop_token_ids[0]) and matcher.is_terminated()


def test_five_thousand_choices_mask_the_first_token_and_take_any_of_them(vocabulary):
    strings = choices(NUM_CHOICES)
    grammar = build_grammar("choice", json.dumps(strings), vocabulary.tokenizer)
    first = allowed(vocabulary, matcher_of(vocabulary.tokenizer, "choice", grammar, vocabulary.stop_token_ids))
    assert {tokens(vocabulary, s)[0] for s in strings} <= first
    for text in (strings[0], strings[1999], strings[2000], strings[-1]):
        write(vocabulary, grammar, text)


def test_a_choice_that_is_a_prefix_of_another_may_end_or_go_on(vocabulary):
    grammar = build_grammar("choice", json.dumps(["ab", "abcdef", "x"]), vocabulary.tokenizer)
    write(vocabulary, grammar, "ab", only_the_end=False)
    write(vocabulary, grammar, "abcdef")


def test_five_thousand_choices_beside_tools_or_after_thinking(vocabulary):
    """A guided_choice inside the tool grammar (tool_choice auto: that answer or calls) and after a reasoning
    model's thinking is one terminal too."""
    strings = choices(NUM_CHOICES)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    spec = parse_tools({"tools": [tool]})
    for tools, chat in ((spec, None), (None, ChatFormat(reasoning="think", think_in_prompt=True))):
        kind, source = answer_constraint(("choice", json.dumps(strings)), tools, chat)
        grammar = build_grammar(kind, source, vocabulary.tokenizer)
        prefix = "</think>\n" if chat is not None else ""
        write(vocabulary, grammar, prefix + strings[-1])
