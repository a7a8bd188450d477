"""The checks every request field goes through, and the OpenAI-style error a failed one answers with."""

from __future__ import annotations

import math

from aiohttp import web

MAX_CACHE_SALT_CHARS = 256


class ApiError(Exception):
    """An error answered to the client with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type, self.headers = error_type, headers or {}

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=self.headers)


def show(value) -> str:
    """A short rendering of a client value for an error message: never the repr of a whole nested body."""
    if isinstance(value, (list, dict)):
        return f"<a JSON {'array' if isinstance(value, list) else 'object'}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def checked_text(value: str, param: str) -> str:
    """msgpack sends str as UTF-8, which has no encoding for a lone surrogate (JSON's "\\ud800"): the send to
    a prefill worker would fail and stall it, so such text stops here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{param} must be valid Unicode text: it holds a lone surrogate "
                            f"U+{ord(value[err.start]):04X} at character {err.start}", param, "invalid_value") from None
    return value


def get_field(body: dict, name: str, kind, required: bool = False, default=None):
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"{name!r} is required", name, "missing_required_parameter")
        return default
    value = body[name]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = kind.__name__ if isinstance(kind, type) else "number"
        raise ApiError(400, f"{name!r} must be of type {expected}, not {type(value).__name__}", name, "invalid_type")
    return value


def nested_string(item: dict, name: str, param: str) -> str:
    """item[name], a string inside a list entry named param (for example "input[2]"): else a 400 naming param.name."""
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{param}.{name} must be a string", f"{param}.{name}", "invalid_type")
    return value


def get_int(body: dict, name: str, low: int, high: int, default):
    value = get_field(body, name, int, default=default)
    if value is not default and not low <= value <= high:
        raise ApiError(400, f"{name!r} must be between {low} and {high}, got {show(value)}", name, "invalid_value")
    return value


def get_number(body: dict, name: str, low: float, high: float, default: float, open_low: bool = False) -> float:
    value = get_field(body, name, (int, float), default=default)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float: refused below like infinity
        value = math.inf
    if not math.isfinite(value) or value > high or value < low or (open_low and value == low):
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ApiError(400, f"{name!r} must be in {bound}, got {value}", name, "invalid_value")
    return value


def cache_salt(body: dict) -> str:
    """The client's own cache salt (vLLM's field), on every generation API."""
    salt = checked_text(get_field(body, "cache_salt", str, default=""), "cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"'cache_salt' may hold at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}",
                       "cache_salt", "invalid_value")
    return salt


def priority(body: dict) -> int | None:
    """The request's priority (None: the API key's default), on every API."""
    return get_int(body, "priority", -1_000_000, 1_000_000, default=None)
