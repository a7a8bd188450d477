"""Validation of OpenAI request bodies into one internal request, and OpenAI-style error bodies."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aiohttp import web


ROLES = {"system", "user", "assistant", "developer", "tool"}
UNSUPPORTED_IF_SET = {"n": 1, "echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
                      "suffix": None, "tools": None, "functions": None, "logit_bias": None}


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


@dataclass(frozen=True)
class GenerateRequest:
    kind: str  # "chat" or "completion"
    model: str
    sampling: dict  # prefill_cpu.handoff.SamplingParams fields (max_tokens None until the policy decides)
    stream: bool
    include_usage: bool
    priority: int | None  # None: the API key's default
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    chat_logprobs: bool = False  # chat: logprobs as objects; completions: as parallel lists
    user_text: str = ""  # every piece of client text, for content filters


def parse_request(body, kind: str) -> GenerateRequest:
    """Types and ranges only; what a client may ask for (models, token limits) is the policy's call."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _field(body, "model", str, required=True)
    for name, neutral in UNSUPPORTED_IF_SET.items():
        if body.get(name, neutral) not in (neutral, None):
            raise ApiError(400, f"{name}={body[name]!r} is not supported by this server", name, "unsupported_parameter")
    stream = _field(body, "stream", bool, default=False)
    stream_options = _field(body, "stream_options", dict, default=None) or {}
    include_usage = bool(stream_options.get("include_usage", False))
    if kind == "chat":
        messages = _messages(body)
        chat_logprobs = _field(body, "logprobs", bool, default=False)
        top = _int(body, "top_logprobs", 0, 20, default=0)
        logprobs = top if chat_logprobs else None
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        text = "\n".join(_content_text(m.get("content")) for m in messages)
        prompt = prompt_tokens = None
    else:
        messages, chat_logprobs = None, False
        prompt, prompt_tokens = _prompt(body)
        logprobs = _int(body, "logprobs", 0, 20, default=None)
        max_tokens = body.get("max_tokens")
        text = prompt or ""
    sampling = {
        "temperature": _number(body, "temperature", 0.0, 2.0, default=1.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, default=1.0, open_low=True),
        "top_k": max(0, _int(body, "top_k", -1, 1_000_000, default=0)),
        "seed": _int(body, "seed", -2**63, 2**63 - 1, default=None),
        "max_tokens": _max_tokens(max_tokens),
        "stop": _stop(body),
        "stop_token_ids": tuple(_int_list(body, "stop_token_ids")),
        "logprobs": logprobs,
    }
    priority = _int(body, "priority", -1_000_000, 1_000_000, default=None)
    return GenerateRequest(kind, model, sampling, stream, include_usage, priority, prompt,
                           prompt_tokens, messages, chat_logprobs, text)


def _field(body: dict, name: str, kind, required: bool = False, default=None):
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"{name!r} is required", name, "missing_required_parameter")
        return default
    value = body[name]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"{name!r} must be of type {kind.__name__}, not {type(value).__name__}", name, "invalid_type")
    return value


def _int(body: dict, name: str, low: int, high: int, default):
    value = _field(body, name, int, default=default)
    if value is not default and not low <= value <= high:
        raise ApiError(400, f"{name!r} must be between {low} and {high}, got {value}", name, "invalid_value")
    return value


def _number(body: dict, name: str, low: float, high: float, default: float, open_low: bool = False) -> float:
    value = _field(body, name, (int, float), default=default)
    value = float(value)
    if not math.isfinite(value) or value > high or value < low or (open_low and value == low):
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ApiError(400, f"{name!r} must be in {bound}, got {value}", name, "invalid_value")
    return value


def _max_tokens(value) -> int | None:
    if value is None:
        return None  # the policy's default applies
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"'max_tokens' must be an integer, not {type(value).__name__}", "max_tokens", "invalid_type")
    if value < 1:
        raise ApiError(400, f"'max_tokens' must be at least 1, got {value}", "max_tokens", "invalid_value")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop",
                       "invalid_value")
    return tuple(stops)


def _int_list(body: dict, name: str) -> list[int]:
    value = body.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ApiError(400, f"{name!r} must be a list of integers", name, "invalid_type")
    return value


def _prompt(body: dict) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", "prompt", "invalid_value")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return None, tuple(prompt)
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt", "missing_required_parameter")
    raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids", "prompt",
                   "invalid_type")


def _messages(body: dict) -> tuple[dict, ...]:
    messages = _field(body, "messages", list, required=True)
    if not messages:
        raise ApiError(400, "'messages' must not be empty", "messages", "invalid_value")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role in {sorted(ROLES)}", f"messages[{i}]",
                           "invalid_value")
        clean.append({"role": message["role"], "content": _content_text(message.get("content"), i)})
    return tuple(clean)


def _content_text(content, index: int | None = None) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    if content is None and index is None:
        return ""
    raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts",
                   f"messages[{index}].content", "invalid_type")
