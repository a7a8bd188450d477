"""Tool calls out of a model's answer, in its family's format (edge.chat.tool_formats), finished or as it streams.

`ToolCallStream` is fed the answer's text as it comes and gives what may go out now: content (the text before the
calls, held back only where it may be the start of a call) and OpenAI `tool_calls` deltas (a call's index, id,
type and name once its name is complete, then fragments of its arguments' JSON text as they are written; the
fragments of a call join into its arguments). `parse_tool_calls` runs the same over a finished answer, so a
streamed answer and a whole one agree.

Where calls start: at an opener of the format anywhere (`<tool_call>`, `<|python_tag|>`, `[TOOL_CALLS]`,
`functools[`), or, for formats whose calls are the whole answer (Llama 3.x JSON, Mistral), at an answer that
starts with `{` or `[` (the engine's text leaves out special tokens, so `<|python_tag|>` and `[TOOL_CALLS]` may
not show). From there on the text is calls: each `{...}` with a "name" among the tools and its "arguments" (or
"parameters"); text after the calls is dropped. What starts like calls and is not (an unknown name, a `[` that
opens a Markdown link) goes out as content after all.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass

from edge.chat.tool_formats import ToolFormat

_DECODER = json.JSONDecoder()
_WHITE = " \t\r\n"
_GLUE = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "functools[", "[", "]", ",", ";")
_ALNUM = string.ascii_letters + string.digits


def new_call_id(fmt: ToolFormat) -> str:
    if fmt.id_chars:
        return "".join(secrets.choice(_ALNUM) for _ in range(fmt.id_chars))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Object:
    """One `{...}` of the calls, as far as it is written: spans are offsets into the answer's text."""
    name: str | None = None
    arguments: tuple[int, int | None] | None = None  # (start, end) of its arguments' JSON; end None: unfinished
    end: int | None = None  # after its closing brace; None: unfinished
    bad: bool = False  # not a call (a key other than name/arguments first, not JSON)


@dataclass
class _Call:
    id: str
    name: str
    sent: int = 0  # characters of its arguments sent
    span: tuple[int, int | None] | None = None  # its arguments' JSON in the text, as last scanned


class ToolCallStream:
    def __init__(self, fmt: ToolFormat, names: set[str], parallel: bool = True) -> None:
        self.fmt, self.names, self.parallel = fmt, names, parallel
        self.text = ""
        self.region: int | None = None  # where the calls start
        self.body = 0  # where their first glue or object starts
        self.aborted = False  # it started like calls and was not: all text is content
        self.calls: list[_Call] = []
        self.content = ""  # sent so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content, tool_call deltas) that may go out now; final: the answer is complete."""
        self.text += text
        if self.region is None and not self.aborted:
            self._find_region()
        deltas = self._call_deltas(final) if self.region is not None else []
        if final and self.region is not None and not self.calls:
            self.aborted, self.region = True, None  # it started like calls and never became one
        return self._content(final), deltas

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("", final=True)

    def result(self) -> list[dict]:
        """The calls found, as OpenAI's message.tool_calls (arguments as JSON text; "{}" when none came)."""
        out = []
        for call in self.calls:
            arguments = self._arguments(call)
            out.append({"id": call.id, "type": "function", "function": {"name": call.name,
                                                                        "arguments": arguments or "{}"}})
        return out

    def _find_region(self) -> None:
        found = [(at, len(o)) for o in self.fmt.openers if (at := self.text.find(o)) >= 0]
        head = self.text.lstrip(_WHITE)
        if self.fmt.at_start and head.startswith(self.fmt.at_start):
            found.append((len(self.text) - len(head), 0))
        if found:
            self.region, skip = min(found)
            self.body = self.region + skip

    def _content(self, final: bool) -> str:
        if self.region is not None:
            ready = self.text[:self.region].rstrip(_WHITE)
        elif final:
            ready = self.text
        else:
            ready = self.text[:len(self.text) - self._held()]
        out = ready[len(self.content):]
        self.content += out
        return out

    def _held(self) -> int:
        """Characters at the end that may still become calls: a partial opener, white space, and (for formats
        whose calls are the whole answer) an answer that is white space so far."""
        if self.fmt.at_start and not self.text.strip(_WHITE):
            return len(self.text)
        partial = max((_partial_suffix(self.text, o) for o in self.fmt.openers), default=0)
        return len(self.text) - len(self.text[:len(self.text) - partial].rstrip(_WHITE))

    def _call_deltas(self, final: bool) -> list[dict]:
        objects, bad = _scan_calls(self.text, self.body, final)
        if bad and not self.calls:
            self.aborted, self.region = True, None
            return []
        deltas = []
        for index, obj in enumerate(objects[:None if self.parallel else 1]):
            if index == len(self.calls):
                if obj.name is None:
                    break
                if obj.name not in self.names:
                    if not self.calls:
                        self.aborted, self.region = True, None
                    break
                call = _Call(new_call_id(self.fmt), obj.name)
                self.calls.append(call)
                deltas.append({"index": index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            call = self.calls[index]
            if obj.arguments is not None:
                start, end = obj.arguments
                written = self.text[start:end] if end is not None else self.text[start:]
                if end is None:
                    written = written.rstrip(_WHITE) if not final else written
                if len(written) > call.sent:
                    deltas.append({"index": index, "function": {"arguments": written[call.sent:]}})
                    call.sent = len(written)
            elif final and obj.end is not None and call.sent == 0:
                deltas.append({"index": index, "function": {"arguments": "{}"}})
                call.sent = 2
            call.span = obj.arguments
        return deltas

    def _arguments(self, call: _Call) -> str:
        span = call.span
        if span is None:
            return "{}" if call.sent == 2 else ""
        start, end = span
        return self.text[start:end] if end is not None else self.text[start:start + call.sent]


def parse_tool_calls(text: str, fmt: ToolFormat, names: set[str], parallel: bool = True) -> tuple[str, list[dict]]:
    """(the content, the calls as OpenAI tool_calls) of a finished answer."""
    stream = ToolCallStream(fmt, names, parallel)
    stream.feed(text, final=True)
    calls = stream.result()
    return stream.content if calls else text, calls


def _scan_calls(text: str, pos: int, final: bool) -> tuple[list[_Object], bool]:
    """The objects of the calls from pos, and whether something that is no call came before any of them."""
    objects = []
    while True:
        pos = _skip_glue(text, pos)
        if pos >= len(text) or _is_partial_glue(text[pos:]):
            return objects, False
        if text[pos] != "{":
            return objects, not objects
        obj = _scan_object(text, pos, final)
        if obj.bad:
            return objects, not objects
        objects.append(obj)
        if obj.end is None:
            return objects, False
        pos = obj.end


def _skip_glue(text: str, pos: int) -> int:
    while pos < len(text):
        if text[pos] in _WHITE:
            pos += 1
            continue
        glue = next((g for g in _GLUE if text.startswith(g, pos)), None)
        if glue is None or _is_partial_glue(text[pos:]):  # nothing, or the start of a longer tag: wait
            return pos
        pos += len(glue)
    return pos


def _is_partial_glue(rest: str) -> bool:
    return any(g.startswith(rest) and g != rest for g in _GLUE)


def _scan_object(text: str, pos: int, final: bool) -> _Object:
    """The call object starting at text[pos] == "{", as far as it is written."""
    obj, pos, n = _Object(), pos + 1, len(text)
    while True:
        pos = _skip_white(text, pos)
        if pos >= n:
            return obj
        if text[pos] == "}":
            obj.end = pos + 1
            return obj
        if text[pos] == ",":
            pos += 1
            continue
        if text[pos] != '"':
            obj.bad = True
            return obj
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return obj  # the key is still being written
        if obj.name is None and key not in ("name", "arguments", "parameters"):
            obj.bad = True  # a JSON object, not a call
            return obj
        pos = _skip_white(text, pos)
        if pos >= n:
            return obj
        if text[pos] != ":":
            obj.bad = True
            return obj
        pos = _skip_white(text, pos + 1)
        value, end = _value(text, pos, final)
        if key in ("arguments", "parameters"):
            obj.arguments = (pos, end)
        elif key == "name" and end is not None:
            if not isinstance(value, str):
                obj.bad = True
                return obj
            obj.name = value
        if end is None:
            return obj
        pos = end


def _value(text: str, pos: int, final: bool):
    """(the JSON value at pos, its end), or (None, None) while it is unfinished."""
    if pos >= len(text):
        return None, None
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except (json.JSONDecodeError, RecursionError):
        return None, None
    if end == len(text) and not final and not isinstance(value, (str, dict, list)):
        return None, None  # a number, true or null may go on
    return value, end


def _skip_white(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITE:
        pos += 1
    return pos


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
