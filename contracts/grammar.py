"""Structured outputs: what a request may constrain its output to, as one (kind, source) pair in
SamplingParams.structured, and the grammar each kind means, built with xgrammar (imported on first use: the
gateway only checks, the prefill worker and the decode engine compile and mask).

Kinds: "json_schema" (source: the schema as JSON text), "json_object" (any JSON object; source ""),
"regex", "choice" (source: a JSON array of the allowed strings), "grammar" (EBNF, xgrammar's GBNF dialect).
"""

from __future__ import annotations

import functools
import json

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_CHARS = 256 * 1024


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says why, for a 400."""


def build_grammar(kind: str, source: str):
    """The xgrammar.Grammar of a constraint; GrammarError when it does not compile."""
    import xgrammar as xgr
    if kind not in KINDS:
        raise GrammarError(f"unknown structured output kind {kind!r}; one of {', '.join(KINDS)}")
    if len(source) > MAX_SOURCE_CHARS:
        raise GrammarError(f"the {kind} constraint has {len(source)} characters, more than {MAX_SOURCE_CHARS}")
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(source, any_whitespace=False)
        if kind == "json_object":  # an object, as OpenAI's json_object means (xgrammar's builtin also takes arrays)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(source)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(source))
        return xgr.Grammar.from_ebnf(source)
    except GrammarError:
        raise
    except Exception as err:  # xgrammar raises RuntimeError (or its own errors) with the converter's message
        raise GrammarError(f"the {kind} constraint does not compile: {_short(err)}") from None


def check(kind: str, source: str) -> None:
    """Raise GrammarError if the constraint does not compile (the gateway's check, cached)."""
    _checked(kind, source)


@functools.lru_cache(maxsize=256)
def _checked(kind: str, source: str) -> bool:
    build_grammar(kind, source)
    return True


def _choice_ebnf(source: str) -> str:
    choices = json.loads(source)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("a choice constraint must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _short(err: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location: keep what explains."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ".cc:" in text.split(" ", 1)[0]:
        text = text.split(" ", 1)[1] if " " in text else text
    return text[:300]
