"""POST /v1/responses' body (OpenAI Responses) read into the chat request (edge.api.chat_request), every refusal
naming the Responses field: input items, instructions, max_output_tokens, text.format, flat function tools.

A conversation goes on from a stored response (`previous_response_id`, edge.api.response_store): its items come
before this body's input, as the client would have sent them."""

from __future__ import annotations

from edge.api.chat_request import ChatParts, call_arguments, chat_request, checked_tool, tool_spec
from edge.api.fields import ApiError, cache_salt, checked_text, get_field, nested_string, priority, show
from edge.api.generate_request import GenerateRequest
from edge.api.sampling_fields import read_sampling
from edge.api.structured import json_schema
from edge.chat.tool_formats import ChatFormat

ROLES = {"user", "system", "developer", "assistant"}
TEXT_PARTS = {"input_text", "output_text", "text"}
# fields of hosted state or features this server cannot honour: (field, the value it may have)
REFUSED = {"conversation": None, "background": False, "prompt": None, "truncation": "disabled"}
# SamplingRequest's fields a Responses body sets (ours beside OpenAI's), under their Responses names
SAMPLING_NAMES = {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed",
                  "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "stop": "stop"}


def parse_responses(body, vocab_size: int | None = None, chat: ChatFormat | None = None,
                    earlier: tuple[dict, ...] = ()) -> GenerateRequest:
    """earlier: the stored conversation's items (input and output) that this body's input continues."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = checked_text(get_field(body, "model", str, required=True), "model")
    for name, neutral in REFUSED.items():
        if body.get(name, neutral) not in (neutral, None):
            why = ("this server keeps no conversations; send previous_response_id or the earlier turns as input items"
                   if name == "conversation" else "it is not supported by this server")
            raise ApiError(400, f"{name}={show(body[name])}: {why}", name, "unsupported_parameter")
    if body.get("top_logprobs"):
        raise ApiError(400, "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                       "top_logprobs", "unsupported_parameter")
    store = get_field(body, "store", bool, default=True)
    previous = get_field(body, "previous_response_id", str, default=None)
    items = input_items(body)
    messages = _instructions(body) + _messages(earlier, "previous_response_id's input") + _messages(items)
    tools = _tools(body, chat)
    sampling = read_sampling(body, SAMPLING_NAMES, vocab_size)
    parts = ChatParts(model, messages, sampling, get_field(body, "stream", bool, default=False), tools,
                      _text_format(body), priority=priority(body),
                      cache_salt=cache_salt(body), messages_param="input", history=(*earlier, *items), store=store,
                      previous_response_id=previous)
    return chat_request(parts, chat)


def input_items(body: dict) -> tuple[dict, ...]:
    """The body's input as a list of items (a string is one user message)."""
    items = body.get("input")
    if isinstance(items, str):
        return ({"type": "message", "role": "user", "content": checked_text(items, "input")},)
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of input items", "input",
                       "missing_required_parameter" if items is None else "invalid_type")
    return tuple(items)


def _instructions(body: dict) -> tuple[dict, ...]:
    instructions = get_field(body, "instructions", str, default=None)
    return ({"role": "system", "content": checked_text(instructions, "instructions")},) if instructions else ()


def _messages(items: tuple, name: str = "input") -> tuple[dict, ...]:
    """Input items as chat messages; consecutive function calls are one assistant turn. name: whose items, for
    errors (the body's input, or a stored conversation's)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        param = f"{name}[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ApiError(400, f"{param}.role must be one of {sorted(ROLES)}", f"{param}.role", "invalid_value")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content"),
                             "tool_calls": ()})
        elif kind == "function_call":
            call = {"name": checked_text(nested_string(item, "name", param), f"{param}.name"),
                    "arguments": call_arguments(nested_string(item, "arguments", param), f"{param}.arguments"),
                    "id": _call_id(item, param)}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last["tool_calls"]:
                last["tool_calls"] += (call,)  # consecutive calls are one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": (call,)})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _call_id(item, param), "tool_calls": (),
                             "content": _text(item.get("output"), f"{param}.output")})
        elif kind != "reasoning":  # an earlier turn's reasoning: templates leave it out of the prompt, as we do
            raise ApiError(400, f"{param}.type {show(kind)} is not supported here (message, function_call, "
                                f"function_call_output or reasoning)", f"{param}.type", "unsupported_parameter")
    return tuple(messages)


def _call_id(item: dict, param: str) -> str:
    call_id = item.get("call_id")
    return checked_text(call_id, f"{param}.call_id") if isinstance(call_id, str) else ""


def _text(content, param: str) -> str:
    """A message's content: a string or text parts (input_text, output_text), joined; other parts are refused."""
    if isinstance(content, str):
        return checked_text(content, param)
    if not isinstance(content, list):
        raise ApiError(400, f"{param} must be a string or a list of input_text parts", param, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{param}[{j}]: only text parts ({{\"type\": \"input_text\", \"text\": ...}}) are "
                                f"supported, got type {show(kind)} (this server serves a text-only model)",
                           f"{param}[{j}]", "unsupported_parameter")
        texts.append(checked_text(part["text"], f"{param}[{j}].text"))
    return "".join(texts)


def _tools(body: dict, chat: ChatFormat | None):
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools", "tools", "invalid_type")
    specs = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"tools[{i}]: only function tools are supported, not {show(kind)} (hosted tools "
                                f"need services this server does not run)", f"tools[{i}]", "unsupported_parameter")
        specs.append(checked_tool(tool, f"tools[{i}]"))
    parallel = get_field(body, "parallel_tool_calls", bool, default=True)
    if choice is None or choice in ("none", "auto", "required"):
        return tool_spec(specs, choice or "auto", None, parallel, chat)
    named = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if named not in {t["name"] for t in specs}:
        raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...} "
                            "naming one of the tools", "tool_choice", "invalid_value")
    return tool_spec(specs, "named", named, parallel, chat)


def _text_format(body: dict) -> tuple[str | None, tuple[str, str] | None]:
    """text.format: (its field, the constraint), or (None, None) for plain text."""
    text = get_field(body, "text", dict, default=None)
    fmt = (text or {}).get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None, None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format.schema must be a JSON schema object", "text.format", "invalid_value")
        return "text.format", json_schema(fmt["schema"], "text.format.schema", "text.format")
    if kind == "json_object":
        return "text.format", ("json_object", "")
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, not {show(kind)}",
                   "text.format", "invalid_value")
