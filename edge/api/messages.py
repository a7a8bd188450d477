"""POST /v1/messages (Anthropic Messages) and POST /v1/messages/count_tokens: the body becomes a chat completions
request, the answer (edge.api.completion) becomes a message and Anthropic's stream events, and every error answers in
Anthropic's shape ({"type": "error", "error": {"type", "message"}}) with the same HTTP status as on chat."""

from __future__ import annotations

import json

from aiohttp import web

from edge.api.client_api import ClientApi, StreamWriter, sse_event
from edge.api.completion import ChoiceDelta, Completion
from edge.api.fields import get_field, get_number, nested_string, show
from edge.api.openai_request import ApiError, GenerateRequest, parse_request

ROLES = {"user", "assistant"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error"}
PASSED = ("priority", "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "cache_salt",
          "stream", "top_p", "top_k")
PARAMS = {"max_tokens": "max_tokens", "stop": "stop_sequences", "messages": "messages",
          "response_format": "output_config.format"}
# an earlier turn's thinking: left out of the prompt, as templates do
IGNORED_BLOCKS = {"thinking", "redacted_thinking"}


def error_response(err: ApiError) -> web.Response:
    """An ApiError in Anthropic's shape."""
    return web.json_response(error_body(err), status=err.status, headers=err.headers)


def error_body(err: ApiError) -> dict:
    error_type = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": err.message}}


class MessagesApi(ClientApi):
    route = "/v1/messages"

    def parse(self, body, vocab_size: int | None, chat=None) -> GenerateRequest:
        translated = chat_body(body, count_only=False)
        try:
            return parse_request(translated, "chat", vocab_size=vocab_size, chat=chat)
        except ApiError as err:
            raise _renamed(err) from None

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


def chat_body(body, count_only: bool) -> dict:
    """The chat completions body an Anthropic Messages body asks for. count_only: count_tokens's body, which has
    no max_tokens."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if not count_only:
        max_tokens = get_field(body, "max_tokens", int, required=True)
        if max_tokens < 1:
            raise ApiError(400, f"'max_tokens' must be at least 1, got {show(max_tokens)}", "max_tokens",
                           "invalid_value")
    get_number(body, "temperature", 0.0, 1.0, default=1.0)  # Anthropic's range, narrower than chat's
    chat = {"model": body.get("model"), "messages": _messages(body)}
    chat.update({name: body[name] for name in PASSED if name in body})
    for name in ("max_tokens", "temperature"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if (fmt := _output_format(body)) is not None:
        chat["response_format"] = fmt
    if (tools := _tools(body)) is not None:
        chat["tools"] = tools
        choice, parallel = _tool_choice(body.get("tool_choice"), [t["function"]["name"] for t in tools])
        chat["tool_choice"], chat["parallel_tool_calls"] = choice, parallel
    elif body.get("tool_choice") not in (None, {"type": "none"}, {"type": "auto"}):
        raise ApiError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
    return chat


def _messages(body: dict) -> list[dict]:
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    messages = get_field(body, "messages", list, required=True)
    if not messages:
        raise ApiError(400, "'messages' must hold at least one message", "messages", "invalid_value")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ApiError(400, f"{param}.role must be user or assistant", f"{param}.role", "invalid_value")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{param}.content must be a string or a list of content blocks", f"{param}.content",
                           "invalid_type")
        out.extend(_blocks(role, content, f"{param}.content"))
    return out


def _blocks(role: str, blocks: list, param: str) -> list[dict]:
    """One Anthropic message's blocks as chat messages: tool results become tool messages (before the turn's
    text, where Anthropic puts them), an assistant's tool uses its tool calls."""
    texts, calls, results = [], [], []
    allowed = {"text", "tool_result"} if role == "user" else {"text", "tool_use"}
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"{param}[{j}]"
        if kind in IGNORED_BLOCKS and role == "assistant":
            continue
        if kind not in allowed:
            raise ApiError(400, f"{where}: a {role} message's blocks may be {' or '.join(sorted(allowed))} here, not "
                                f"{show(kind)} (this server serves a text-only model)", where, "unsupported_parameter")
        if kind == "text":
            texts.append(nested_string(block, "text", where))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise ApiError(400, f"{where}.input must be an object", f"{where}.input", "invalid_type")
            calls.append({"type": "function", "id": block.get("id") or "",
                          "function": {"name": nested_string(block, "name", where),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        else:
            content = block.get("content", "")
            text = _text(content, f"{where}.content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                            "content": f"Error: {text}" if block.get("is_error") else text})
    text = "".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}] if calls or text else []
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _text(content, param: str) -> str:
    """A string or a list of text blocks, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise ApiError(400, f"{param} must be a string or a list of text blocks ({{\"type\": \"text\", \"text\": ...}})",
                   param, "invalid_type")


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of tools", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"tools[{i}]: only custom tools (name, description, input_schema) are supported, "
                                f"not {show(kind)} (server tools need services this server does not run)",
                           f"tools[{i}]", "unsupported_parameter")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise ApiError(400, f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema",
                           "invalid_value")
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice, names: list[str]) -> tuple[str | dict, bool]:
    """(chat tool_choice, parallel_tool_calls) from Anthropic's {"type": auto|any|tool|none}."""
    if choice is None:
        return "auto", True
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use", False))
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and choice.get("name") in names:
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(400, "tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                        "{\"type\": \"tool\", \"name\": ...} naming one of the tools", "tool_choice", "invalid_value")


def _output_format(body: dict) -> dict | None:
    """output_config.format (Anthropic's structured outputs): a JSON schema the answer must fit."""
    config = get_field(body, "output_config", dict, default=None)
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config.format", "invalid_value")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _renamed(err: ApiError) -> ApiError:
    param = err.param or ""
    for ours, theirs in PARAMS.items():
        if param == ours or param.startswith(ours + "["):
            message = err.message.replace(f"'{ours}'", f"'{theirs}'")
            return ApiError(err.status, message, theirs + param[len(ours):], err.code, err.error_type, err.headers)
    if param.startswith("tools[") and ".function" in param:  # the chat tool this Anthropic tool became
        return ApiError(err.status, err.message.replace(".function", ""), param.replace(".function", ""),
                        err.code, err.error_type, err.headers)
    return err


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
    try:
        return parse_request(_counted_body(body), "chat", vocab_size=None, chat=chat)
    except ApiError as err:
        raise _renamed(err) from None


def worker_messages(request: GenerateRequest) -> list[dict]:
    """The messages as a prefill worker hands them to the template (the gateway's ChatMessage, then the worker's
    dicts), so the count is the prompt's."""
    return [{"role": m["role"], "content": m["content"], "tool_calls": m.get("tool_calls_json", ""),
             "tool_call_id": m.get("tool_call_id", "")} for m in request.messages]


def _counted_body(body) -> dict:
    chat = chat_body(body, count_only=True)
    chat.pop("stream", None)
    return chat
