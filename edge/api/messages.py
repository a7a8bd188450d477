"""POST /v1/messages (Anthropic Messages) and POST /v1/messages/count_tokens: the body is read by its own parser
(edge.api.messages_request), the answer (edge.api.completion) becomes a message and Anthropic's stream events, and
every error answers in Anthropic's shape ({"type": "error", "error": {"type", "message"}}) with the same HTTP status
as on chat."""

from __future__ import annotations

import json

from aiohttp import web

from edge.api.client_api import ClientApi, StreamWriter, sse_event
from edge.api.completion import ChoiceDelta, Completion
from edge.api.fields import ApiError
from edge.api.generate_request import GenerateRequest
from edge.api.messages_request import parse_messages

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error"}


def error_response(err: ApiError) -> web.Response:
    """An ApiError in Anthropic's shape."""
    return web.json_response(error_body(err), status=err.status, headers=err.headers)


def error_body(err: ApiError) -> dict:
    error_type = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": err.message}}


class MessagesApi(ClientApi):
    route = "/v1/messages"

    def parse(self, body, vocab_size: int | None, chat=None, earlier: tuple[dict, ...] = ()) -> GenerateRequest:
        return parse_messages(body, vocab_size, chat)

    def error(self, err: ApiError) -> web.Response:
        return error_response(err)

    def body(self, completion: Completion) -> dict:
        message, reason = completion.message(completion.choices[0])
        blocks = []
        if message.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            blocks.append({"type": "text", "text": message["content"]})
        blocks.extend(_tool_use(call) for call in message.get("tool_calls") or ())
        return {**_message(completion, blocks), "stop_reason": STOP_REASONS.get(reason),
                "usage": _usage(completion)}

    def writer(self, completion: Completion) -> StreamWriter:
        return MessagesStream(completion)


def message_id(completion: Completion) -> str:
    return "msg_" + completion.request_id.split("-", 1)[-1]


def _message(completion: Completion, content: list[dict]) -> dict:
    return {"id": message_id(completion), "type": "message", "role": "assistant", "model": completion.model,
            "content": content, "stop_reason": None, "stop_sequence": None}


def _usage(completion: Completion) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens not read from a cache, cache_read_input_tokens the
    ones the prefill worker's prompt cache held (their sum is the prompt, what count_tokens says)."""
    cached = completion.num_cached_tokens
    return {"input_tokens": completion.num_prompt_tokens - cached, "output_tokens": completion.num_output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_use(call: dict) -> dict:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": function["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


class MessagesStream(StreamWriter):
    """Anthropic's stream: message_start; per content block content_block_start, its deltas (text_delta,
    thinking_delta, input_json_delta) and content_block_stop; then message_delta (stop_reason, output usage) and
    message_stop. An error after the headers is an `error` event."""

    def __init__(self, completion: Completion) -> None:
        self.completion = completion
        self.index = 0  # the next block's index
        self.open_kind: str | None = None  # "text", "thinking" or "tool_use" while such a block is open
        self.reason: str | None = None

    def open(self) -> bytes:
        message = {**_message(self.completion, []), "usage": {**_usage(self.completion), "output_tokens": 0}}
        return sse_event("message_start", {"type": "message_start", "message": message})

    def event(self, delta: ChoiceDelta | None) -> bytes:
        if delta is None:
            return b""
        out = b""
        if delta.reasoning:
            out += self._text("thinking", delta.reasoning)
        if delta.content:
            out += self._text("text", delta.content)
        for fragment in delta.calls:
            out += self._call_fragment(fragment)
        if delta.finish_reason is not None:
            self.reason = delta.finish_reason
            out += self._stop_block()
        return out

    def _start(self, kind: str, block: dict) -> bytes:
        self.open_kind = kind
        return sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block})

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _text(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open_kind != kind:
            out += self._stop_block()
            out += self._start(kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": ""})
        return out + self._delta({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                                 else {"type": "text_delta", "text": text})

    def _call_fragment(self, fragment: dict) -> bytes:
        """Chat's call fragments: the first names the call (a tool_use block starts), the rest carry arguments."""
        out = b""
        function = fragment.get("function", {})
        if fragment.get("id") or self.open_kind != "tool_use":
            out += self._stop_block()
            call_id = "toolu_" + (fragment.get("id") or f"{self.index}").removeprefix("call_")
            out += self._start("tool_use", {"type": "tool_use", "id": call_id, "name": function.get("name", ""),
                                            "input": {}})
        if function.get("arguments"):
            out += self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        return out

    def _stop_block(self) -> bytes:
        if self.open_kind is None:
            return b""
        self.open_kind = None
        self.index += 1
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})

    def close(self) -> bytes:
        out = self._stop_block()
        usage = _usage(self.completion)
        out += sse_event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": STOP_REASONS.get(self.reason or ""), "stop_sequence": None}, "usage": usage})
        return out + sse_event("message_stop", {"type": "message_stop"})

    def error(self, err: ApiError) -> bytes:
        return sse_event("error", error_body(err))


def parse_count(body, chat=None) -> GenerateRequest:
    """POST /v1/messages/count_tokens's body (no max_tokens, no stream) as the request chat sees it."""
    return parse_messages(body, None, chat, count_only=True)


def worker_messages(request: GenerateRequest) -> list[dict]:
    """The messages as a prefill worker hands them to the template (the gateway's ChatMessage, then the worker's
    dicts), so the count is the prompt's."""
    return [{"role": m["role"], "content": m["content"], "tool_calls": m.get("tool_calls_json", ""),
             "tool_call_id": m.get("tool_call_id", "")} for m in request.messages]

