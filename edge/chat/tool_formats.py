"""Tool-call formats per model family: which one a model's chat template speaks, and the grammar that makes a call
in it well formed.

A format is how a family writes its calls (what its chat template tells it to write):
- "hermes" (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
  per call;
- "llama3_json" (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}`, the whole answer, after an optional
  `<|python_tag|>`; parallel calls separated by `; `;
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- "phi4_mini" (Phi-4-mini): `functools[{"name": ..., "arguments": {...}}, ...]`.
The format is detected from the template's text (ChatFormat, `detect`) or set by the `tool_call_parser` option.
A template that renders `tools` itself in a detected format gets them (the prefill worker passes them to it);
any other template (the embedded SmolLM2's has no tool support, Gemma's none either) gets the Hermes system text
from the gateway (edge.chat.tools) and is parsed as Hermes.

Grammars (`tools_grammar`): with tool_choice "auto" the answer is free text or, once a call starts (its opening
tag, or the JSON at the start of the answer), a well-formed call; "required" and a named function allow calls
only. Each call's JSON is {"name": <a tool>, <arguments key>: <that tool's parameters schema>}. Written in
llguidance's Lark dialect, compiled like any other constraint (contracts.grammar, kind "grammar").
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from functools import lru_cache

from contracts.grammar import JSON_OPTIONS


@dataclass(frozen=True)
class ToolFormat:
    name: str
    openers: tuple[str, ...]  # text that starts the calls wherever it appears
    at_start: str  # "" or the character that starts the calls when the answer begins with it
    arguments_key: str  # what the call's JSON names its arguments
    begin: str  # the grammar's text before the first call ...
    separator: str  # ... between two calls ...
    end: str  # ... and after the last
    id_chars: int = 0  # 0: ids are call_<24 hex>; n: n letters and digits (Mistral's templates check for 9)


FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), "", "arguments", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n",
                         "\n</tool_call>"),
    "llama3_json": ToolFormat("llama3_json", ("<|python_tag|>",), "{", "parameters", "", "; ", ""),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), "[", "arguments", "[", ", ", "]", id_chars=9),
    "phi4_mini": ToolFormat("phi4_mini", ("functools[",), "", "arguments", "functools[", ", ", "]"),
}


@dataclass(frozen=True)
class ChatFormat:
    """What the gateway knows of the model's chat template (edge.http.routes reads it from the GGUF once)."""
    tool_parser: str = "hermes"  # a key of FORMATS (the tool_call_parser knob's choices but auto)
    template_tools: bool = False  # the template renders `tools` itself (else the gateway writes the Hermes text)
    reasoning: str = ""  # "" or "think": the model thinks first, in <think> tags (edge.chat.reasoning)
    think_in_prompt: bool = False  # the template's generation prompt opens the thinking (DeepSeek-R1's `<think>\n`)

    @property
    def tool_format(self) -> ToolFormat:
        return FORMATS[self.tool_parser]


# --- detection from the template's text -------------------------------------------------------------------------
_TOOLS_VARIABLE = re.compile(r"{[{%]-?[^}]*\btools\b")  # `tools` used in a Jinja expression or statement
_MESSAGE_TOOLS = re.compile(r"message\s*(\[\s*['\"]tools['\"]\s*\]|\.tools\b)")  # Phi-4-mini: the system message's


def detect_tool_format(template: str) -> str | None:
    """The format a template writes calls in, or None when it defines none."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    if "functools" in template or ("<|tool|>" in template and _MESSAGE_TOOLS.search(template)):
        return "phi4_mini"
    return None


def renders_tools(template: str) -> bool:
    """The template writes the tools it is given (the `tools` variable, or Phi-4-mini's system message `tools`)."""
    return bool(_TOOLS_VARIABLE.search(template) or _MESSAGE_TOOLS.search(template))


def detect(template: str | None, tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> ChatFormat:
    """The chat format of a template (None: the model has none), with the options' choices where not "auto"
    (reasoning_parser "none": the model is not treated as thinking)."""
    from edge.chat.reasoning import detect_reasoning, opens_thinking
    template = template or ""
    found = detect_tool_format(template)
    parser = found or "hermes" if tool_call_parser == "auto" else tool_call_parser
    template_tools = renders_tools(template) and (found is not None or tool_call_parser != "auto")
    reasoning = detect_reasoning(template) if reasoning_parser == "auto" else \
        "" if reasoning_parser == "none" else reasoning_parser
    return ChatFormat(parser, template_tools, reasoning, bool(reasoning) and opens_thinking(template))


# --- the template from the GGUF ----------------------------------------------------------------------------------
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def read_chat_template(path: str) -> str | None:
    """`tokenizer.chat_template` of a GGUF file, read from its header alone (the key-value section, skipping the
    token lists by their lengths): milliseconds, where gguf's reader parses every array first."""
    with open(path, "rb") as f:
        magic, _version, _tensors, count = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        for _ in range(count):
            key = _string(f)
            kind = struct.unpack("<I", f.read(4))[0]
            if key == "tokenizer.chat_template" and kind == _STRING:
                return _string(f)
            _skip(f, kind)
    return None


def _string(f) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _skip(f, kind: int) -> None:
    if kind == _STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(_SCALARS[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item)
    elif kind in _SCALARS:
        f.seek(_SCALARS[kind], 1)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


@lru_cache(maxsize=8)
def model_chat_format(path: str | None, tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> ChatFormat:
    """The chat format of the GGUF at path (read once); a file the gateway cannot read (its workers run elsewhere)
    gives the options' choices over no template."""
    try:
        template = read_chat_template(path) if path else None
    except (OSError, ValueError, struct.error):
        template = None
    return detect(template, tool_call_parser, reasoning_parser)


# --- grammars ----------------------------------------------------------------------------------------------------
def call_schema(tools: list[dict], fmt: ToolFormat) -> dict:
    """The JSON schema of one call to any of the tools: {"name": const, <arguments key>: its parameters}. Each
    tool's parameters move to $defs (their local $refs rewritten to follow), so pydantic's nested models resolve."""
    defs, branches = {}, []
    for i, tool in enumerate(tools):
        defs[f"tool{i}"] = _rebased(tool["parameters"], f"#/$defs/tool{i}")
        branches.append({"type": "object", "properties": {"name": {"const": tool["name"]},
                                                          fmt.arguments_key: {"$ref": f"#/$defs/tool{i}"}},
                         "required": ["name", fmt.arguments_key], "additionalProperties": False})
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {"x-guidance": JSON_OPTIONS, **schema, "$defs": defs}


def _rebased(value, base: str):
    """A schema moved under `base`: its local $refs ("#", "#/...") point into it there."""
    if isinstance(value, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_rebased(v, base) for v in value]
    return value


def tools_grammar(tools: list[dict], fmt: ToolFormat, *, free: bool, parallel: bool,
                  answer: str | None = None) -> str:
    """Lark rules ending in `answer_start`: calls in the format; with free, free text too (text that never holds
    an opener, or that does not start like a call); `answer`, a Lark rule body, stands for the answer instead of
    free text (a response_format with tool_choice auto)."""
    more = _seq("(", _lit(fmt.separator), "call)*") if parallel else ""
    rules = ["call: %json " + json.dumps(call_schema(tools, fmt), ensure_ascii=False),
             "calls: " + _seq(_lit(fmt.begin), "call", more, _lit(fmt.end))]
    if not free:
        return "\n".join([*rules, "answer_start: calls"])
    if answer is not None:
        return "\n".join([*rules, f"other: {answer}", "answer_start: other | calls"])
    if fmt.at_start:  # free text may not start with the call's first character (nor with white space)
        return "\n".join([*rules, f"FREE: /([^{re.escape(fmt.at_start)}\\s](.|\\n)*)?/", "answer_start: FREE | calls"])
    # the text holding no opener, or the text up to the first one (one lexeme: it ends there) and then the calls
    opener = fmt.openers[0]
    return "\n".join([rules[0], f"NOCALL: /(.|\\n)*/ & ~/(.|\\n)*{_regex_literal(opener)}(.|\\n)*/",
                      f"HEAD: NOCALL {_lit(opener)}",
                      "answer_start: NOCALL | " + _seq("HEAD", _lit(fmt.begin.removeprefix(opener)), "call", more,
                                                       _lit(fmt.end))])


def grammar(rules: str, prefix: str = "") -> str:
    """A whole Lark grammar: `prefix` (a reasoning block's rules, ending in `think_start`) before the answer."""
    start = "start: think_start answer_start" if prefix else "start: answer_start"
    return "\n".join(x for x in ("%llguidance {}", start, prefix, rules) if x)


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


def _regex_literal(text: str) -> str:
    return re.sub(r"([\\/.^$|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n")


_KNOWN: dict[tuple, ChatFormat] = {}


async def chat_format_of(path: str | None, tool_call_parser: str = "auto", reasoning_parser: str = "auto"
                         ) -> ChatFormat:
    """model_chat_format for the event loop: the first read of a GGUF (a second or so for a large vocabulary) runs
    in a thread; later calls answer at once."""
    key = (path, tool_call_parser, reasoning_parser)
    if key not in _KNOWN:
        import asyncio
        _KNOWN[key] = await asyncio.to_thread(model_chat_format, *key)
    return _KNOWN[key]
