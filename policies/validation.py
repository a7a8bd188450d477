"""Read a TOML file and validate it against a pydantic model, for the policy files and the serve config
alike: every mistake becomes an Issue naming the dotted key path (tiers[1].actions.logprobs), the line
that holds it, and what was expected, and all of a file's mistakes are reported together."""

from __future__ import annotations

import re
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError


@dataclass(frozen=True)
class Issue:
    key: str  # dotted key path, e.g. tiers[1].actions.logprobs; "(syntax)" or "(file)" for the whole file
    message: str  # what is wrong and what was expected
    line: int | None = None


class FileError(ValueError):
    """A file that cannot be used, with every issue found in it; the text has one line per issue."""

    def __init__(self, source: str, issues: list[Issue]) -> None:
        self.source, self.issues = source, issues
        super().__init__("\n".join(f"{source}{_at(issue.line)}: {issue.key}: {issue.message}" for issue in issues))


def _at(line: int | None) -> str:
    return f":{line}" if line else ""


class Invalid(Exception):
    """Raised by the helpers below; the caller adds the source and raises its own FileError subclass."""

    def __init__(self, issues: list[Issue]) -> None:
        super().__init__(issues)
        self.issues = issues


class Strict(BaseModel):
    """Base of every file model. TOML values are already typed, so nothing is coerced ("1" is not an
    integer, true is not 1); unknown keys are refused, since a misspelled key would otherwise be ignored."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
    unknown_key_noun: ClassVar[str] = "key"  # "unknown signal" reads better than "unknown key" in places


MAX_FILE_BYTES = 1 << 20  # a policy or config file, at most: a mistaken 1 GiB file must not take the gateway's memory


def read_text(path: str | Path) -> str:
    """The file's text, read no further than MAX_FILE_BYTES (a larger file is refused, not parsed)."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise Invalid([Issue("(file)", f"cannot read the file: {err.strerror}")]) from None
    if len(data) > MAX_FILE_BYTES:
        raise Invalid([Issue("(file)", f"the file is larger than the limit of {MAX_FILE_BYTES} bytes "
                                       f"({MAX_FILE_BYTES >> 20} MiB); a policy or config file is a few KiB")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Invalid([Issue("(file)", f"the file is not UTF-8 text: {err.reason} at byte {err.start}")]) from None


def parse_toml(text: str) -> tuple[dict, dict[str, int]]:
    """The parsed document, and the line of each dotted key path in it."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        line = re.search(r"line (\d+)", str(err))
        raise Invalid([Issue("(syntax)", f"not valid TOML: {err}", int(line.group(1)) if line else None)]) from None
    return data, key_lines(text)


def validate(model: type[Strict], data: dict, lines: dict[str, int], context: dict | None = None):
    try:
        return model.model_validate(data, context=context)
    except ValidationError as err:
        issues = [issue_at(lines, dotted(e["loc"]), _message(model, e)) for e in err.errors()]
        raise Invalid(sorted(issues, key=lambda i: i.line or 0)) from None  # in the order of the file


def issue_at(lines: dict[str, int], key: str, message: str) -> Issue:
    return Issue(key, message, line_of(lines, key))


_LAST_PART = re.compile(r"(\.[^.\[\]]+|\[\d+\])$")  # .name or [index] at the end of a dotted path


def line_of(lines: dict[str, int], key: str) -> int | None:
    """The line of the key, or of the nearest enclosing table or array that has one (a key in an inline
    table, a value that was left out)."""
    while key:
        if key in lines:
            return lines[key]
        parent = _LAST_PART.sub("", key)
        key = parent if parent != key else ""
    return None


def dotted(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


# --- pydantic's error types, told in the file's terms ---
_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}
_TEMPLATES = {
    "missing": "missing; expected {expected}",
    "literal_error": "expected {expected}, got {value}",
    "string_too_short": "expected a non-empty string, got {value}",
    "finite_number": "expected a finite number, got {value}",
}


def _message(model: type[Strict], error: dict) -> str:
    kind, loc, value, ctx = error["type"], error["loc"], error.get("input"), error.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = _target(model, loc[:-1])
        return f"unknown {parent.unknown_key_noun}; expected one of {sorted(_keys_of(parent))}"
    if kind == "value_error":  # the validators' own messages
        return str(ctx["error"])
    if kind in _BOUNDS:
        name, sign = _BOUNDS[kind]
        return f"expected a value {sign} {ctx[name]}, got {_show(value)}"
    template = _TEMPLATES.get(kind, "expected {expected}, got {kind} {value}")
    return template.format(expected=_describe(_target(model, loc), loc), kind=type(value).__name__,
                           value=_show(value))


def _target(model: type[Strict], loc: tuple) -> Any:
    """The type annotation an error location points at, found by walking the model's fields."""
    node: Any = model
    for part in loc:
        node = _unwrap(node)
        if isinstance(node, type) and issubclass(node, BaseModel):
            node = next((f.annotation for n, f in node.model_fields.items() if (f.alias or n) == part), None)
        elif get_origin(node) in (list, dict):
            node = get_args(node)[-1]  # list[X] and dict[str, X] both hold X
        else:
            return None
    return _unwrap(node)


def _unwrap(node: Any) -> Any:
    """Annotated[X, ...] -> X and X | None -> X: the checks do not change what is expected."""
    while get_origin(node) in (typing.Annotated, typing.Union, types.UnionType):
        node = next(a for a in get_args(node) if a is not type(None))
    return node


def _keys_of(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


_NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
          bool: ("true or false", "booleans")}


def _describe(node: Any, loc: tuple) -> str:
    """What a value at this place should be, in words."""
    if isinstance(node, type) and issubclass(node, BaseModel) or get_origin(node) is dict:
        return "a table"
    if get_origin(node) is Literal:
        return f"one of {list(get_args(node))}"
    if get_origin(node) is not list:
        return _NAMES.get(node, ("a value",))[0]
    item = _unwrap(get_args(node)[0])
    if isinstance(item, type) and issubclass(item, BaseModel):
        return f"an array of tables ([[{loc[-1]}]])"
    return f"a list of {_NAMES.get(item, ('', 'strings' if get_origin(item) is Literal else 'values'))[1]}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- where each key is written: tables, arrays of tables, keys, and the items of multi-line arrays ---
_STRING = r'"(?:[^"\\]|\\.)*"|\'[^\']*\''


def key_lines(text: str) -> dict[str, int]:
    """Map dotted key paths to the line that defines them; a multi-line array also maps each string item,
    so a bad pattern in a long list is pointed at by its own line."""
    lines: dict[str, int] = {}
    table, counters, array = "", {}, None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = re.sub(rf"({_STRING})|#.*", lambda m: m.group(1) or "", raw).strip()
        if array is not None:
            array = _array_items(lines, array, line, number)
        elif header := _table_header(line, counters):
            table = header
            lines[table] = number
        elif match := re.match(r"([\w\-\".]+)\s*=\s*(.*)", line):
            path = ".".join(filter(None, [table, match.group(1).replace('"', "")]))
            lines.setdefault(path, number)
            if match.group(2).startswith("["):
                array = _array_items(lines, (path, 0), match.group(2)[1:], number)
    return lines


def _table_header(line: str, counters: dict[str, int]) -> str | None:
    """The dotted path a [table] or [[array.of.tables]] header opens; counters numbers the array items."""
    if match := re.fullmatch(r"\[\[\s*([\w.-]+)\s*\]\]", line):
        name = match.group(1)
        counters[name] = counters.get(name, -1) + 1
        return f"{name}[{counters[name]}]"
    if match := re.fullmatch(r"\[\s*([\w.\-\"]+)\s*\]", line):
        name = match.group(1).replace('"', "").rstrip(".")  # [a.""]: an empty key, kept by its table's line
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # a table inside the last item of an array of tables, at any depth
            parent = ".".join(parts[:cut])
            if parent in counters:
                return f"{parent}[{counters[parent]}]." + ".".join(parts[cut:])
        return name
    return None


def _array_items(lines: dict[str, int], array: tuple[str, int], segment: str, number: int):
    """Record the string items of an array that appear on this line; None once the array closes here."""
    path, index = array
    rest = re.sub(_STRING, "", segment)
    if re.search(r"[\[{]", rest):  # nested arrays or inline tables: items are not plain strings, stop here
        return None
    for _ in re.finditer(_STRING, segment):
        lines.setdefault(f"{path}[{index}]", number)
        index += 1
    return None if "]" in rest else (path, index)
