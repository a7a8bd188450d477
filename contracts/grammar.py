"""Structured outputs: what a request may constrain its output to, as one (kind, source) pair in
SamplingParams.structured, and the grammar each kind means, built with llguidance (chosen by soundness on
JSONSchemaBench: docs/structured_outputs.md). The gateway checks a constraint, the prefill worker masks the first
token and the decode engine the rest, each with a Matcher from here; contracts.grammar_compile runs the compiles in
bounded pools under a time limit.

Kinds: "json_schema" (source: the schema as JSON text), "json_object" (any JSON object; source ""),
"regex", "choice" (source: a JSON array of the allowed strings), "grammar" (Lark, or llama.cpp's GBNF, which is
converted to Lark).

Fail closed: a schema keyword the engine cannot enforce is an error naming it (llguidance's strict mode: not
`lenient`), never a looser grammar. A grammar past the size and work limits is GrammarTooComplexError.
"""

from __future__ import annotations

import json
import re

import llguidance
from llguidance import LLMatcher, LLParserLimits
from llguidance.gbnf_to_lark import any_to_lark

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_CHARS = 256 * 1024
# How deeply a JSON schema may nest arrays and objects (a flat object: 1). llguidance reads JSON with serde_json,
# which stops at 128 levels, so no deeper schema could compile; checked without recursion before anything that
# recurses (Python's json, the tool schemas' rewriting) runs, so a deep schema is a 400 naming its field.
MAX_SCHEMA_DEPTH = 128


def _default_timeout_s() -> float:
    """The grammar_compile_timeout_s knob's default (contracts.options), for a process not told another."""
    try:
        from contracts.options import KNOBS
        return float(KNOBS["grammar_compile_timeout_s"].default)
    except (ImportError, KeyError):
        return 5.0


DEFAULT_COMPILE_TIMEOUT_S = _default_timeout_s()
# JSON as Python's json.dumps writes it: ", " and ": " and no other whitespace. Free whitespace lets a small model
# pad with newlines until max_tokens; these separators are the ones models write most.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
                "coerce_one_of": False}
# llguidance's wording when a grammar passes its size or work limits
_TOO_COMPLEX = re.compile(r"too (large|big|complex)|fuel|too many|exceeded|limit|symbols\.len", re.IGNORECASE)
_QUOTED = re.compile(r"^\s*(\^+|\d+ \|.*)\s*$")  # a caret line, or a numbered line of the grammar


class GrammarError(ValueError):
    """A constraint that cannot be enforced; the message says why, for a 400."""

    code = "invalid_structured_output"


class GrammarTooComplexError(GrammarError):
    """A constraint past the size, work or time limits of compiling it."""

    code = "structured_output_too_complex"


class GrammarBusyError(GrammarError):
    """Every compile slot is taken (slow compiles still running): an overload, for a 503, not the client's fault."""

    code = "structured_output_busy"


class GrammarOwnerBusyError(GrammarBusyError):
    """The client (its API key, or its address without keys) already holds its share of the compile processes:
    for a 429, so that one key cannot fill the pool."""

    code = "structured_output_compiles_per_key"


def limits() -> LLParserLimits:
    """llguidance's work limits, stated here rather than inherited: each bounds a compile or a mask step, so that
    no grammar can hang the gateway, a prefill worker or the engine (past one, the matcher errs)."""
    return LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                          step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=60_000,
                          verbose_errors=False)


def grammar_text(kind: str, source: str) -> str:
    """llguidance's grammar (its JSON text) of a constraint, not yet checked; GrammarError when it cannot be
    written at all (an unknown kind, bad JSON, a GBNF that does not convert)."""
    if kind not in KINDS:
        raise GrammarError(f"unknown structured output kind {kind!r}; one of {', '.join(KINDS)}")
    if len(source) > MAX_SOURCE_CHARS:
        raise GrammarTooComplexError(f"the {kind} constraint has {len(source)} characters, more than "
                                     f"{MAX_SOURCE_CHARS}")
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(source, overrides=JSON_OPTIONS)
        if kind == "json_object":  # an object, as OpenAI's json_object means
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            return LLMatcher.grammar_from_lark(_choice_lark(source))
        return LLMatcher.grammar_from_lark(any_to_lark(source))
    except GrammarError:
        raise
    except Exception as err:  # bad JSON (ValueError), a GBNF the converter cannot read
        raise GrammarError(f"the {kind} constraint does not compile: {_short(err)}") from None


def json_depth(value, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How deeply a parsed JSON value nests arrays and objects (a scalar: 0, {} or []: 1), found without recursion;
    the walk stops at the first container deeper than limit (and returns its depth, limit + 1)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_schema_depth(schema, field: str) -> None:
    """GrammarTooComplexError naming field when the schema nests deeper than MAX_SCHEMA_DEPTH."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarTooComplexError(f"{field} nests arrays and objects more than {MAX_SCHEMA_DEPTH} levels deep, "
                                     "the most a JSON schema may")


def build_grammar(kind: str, source: str, tokenizer=None) -> str:
    """The checked grammar text of a constraint; GrammarError naming the problem when it does not compile.
    With a tokenizer (llguidance.LLTokenizer), the checks that depend on the vocabulary run too."""
    grammar = grammar_text(kind, source)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits())
    if is_error:
        raise _error(kind, messages[0] if messages else "unknown error")
    return grammar


def compile_matcher(tokenizer, kind: str, source: str, stop_token_ids: tuple[int, ...]) -> Matcher:
    """A fresh Matcher of the constraint over a vocabulary (llguidance.LLTokenizer): the compile (grammar, lexer)
    happens here, and takes microseconds to tens of milliseconds. GrammarError when it fails."""
    return matcher_of(tokenizer, kind, grammar_text(kind, source), stop_token_ids)


def matcher_of(tokenizer, kind: str, grammar: str, stop_token_ids: tuple[int, ...]) -> Matcher:
    """A fresh Matcher of llguidance's grammar text (grammar_text's, or build_grammar's from a compile process)."""
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise _error(kind, matcher.get_error())
    return Matcher(matcher, stop_token_ids)


class Matcher:
    """One sequence's position in its grammar, with the calls the prefill worker and the engine make.
    The stop tokens (the tokenizer's end-of-sequence ones) end the grammar once it is complete."""

    __slots__ = ("_matcher", "_stops", "_terminated")

    def __init__(self, matcher: LLMatcher, stop_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._stops = frozenset(stop_token_ids)
        self._terminated = False

    def copy(self) -> Matcher:
        """A matcher at the same position (a compiled grammar's start, for the next sequence)."""
        return Matcher(self._matcher.deep_copy(), tuple(self._stops))

    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (and the matcher errs from then on) when the grammar does not allow it."""
        if self._terminated or not self._matcher.consume_token(int(token)):
            return False
        self._terminated = token in self._stops
        return True

    def is_terminated(self) -> bool:
        """The grammar was complete and a stop token was taken."""
        return self._terminated

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        """Write the next token's mask (bit j of int32 word w: token 32w + j may come next) to num_bytes of memory
        at address (a row of a contiguous int32 array). GrammarError when the matcher has erred: the sequence must
        fail, never go on unconstrained."""
        self._matcher.unsafe_compute_mask_ptr(address, num_bytes)
        if self._matcher.is_error():
            raise GrammarError(f"the structured output's grammar failed: {self._matcher.get_error()}")


def _error(kind: str, message: str) -> GrammarError:
    text = _short(message)
    if text.startswith("Unimplemented keys: "):  # llguidance's strict mode refusing what it would not enforce
        return GrammarError(f"the {kind} constraint uses {text.removeprefix('Unimplemented keys: ')}, which this "
                            "server does not enforce (unsupported JSON Schema keywords are refused, not ignored)")
    if _TOO_COMPLEX.search(text):
        return GrammarTooComplexError(f"the {kind} constraint is too complex: {text}")
    return GrammarError(f"the {kind} constraint does not compile: {text}")


def _choice_lark(source: str) -> str:
    return "start: CHOICE\n" + choice_terminal("CHOICE", choices_of(source))


def choices_of(source: str) -> list[str]:
    """The strings of a choice constraint's source (a JSON array); GrammarError when it is not a non-empty list of
    non-empty strings."""
    try:
        choices = json.loads(source)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("a choice constraint must be a non-empty list of non-empty strings")
    return choices


def choice_terminal(name: str, choices: list[str]) -> str:
    """The Lark terminal `name` matching exactly one of the strings. One terminal, one lexeme: the lexer matches
    the strings, and the parser sees a single item whatever their number. As a rule of alternatives (`start: "a" |
    "b" | ...`) each string was an item of the parser's first row, and past max_items_in_row (2,000 strings) the
    matcher erred on the first token."""
    return f"{name}: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _short(err) -> str:
    """llguidance's message on one line, without the pointer lines and the grammar excerpt it quotes."""
    text = str(err).split("<backtrace>", 1)[0]  # a panic's message comes with one
    lines = [line.strip() for line in text.splitlines() if line.strip() and not _QUOTED.match(line)]
    return " ".join(lines)[:400] if lines else type(err).__name__


__version__ = llguidance.__version__
