"""POST /v1/messages' body (Anthropic Messages) and count_tokens' read into the chat request
(edge.api.chat_request), every refusal naming the Anthropic field: system, content blocks (text, tool_use,
tool_result), stop_sequences, custom tools with input_schema, Anthropic's tool_choice, output_config.format."""

from __future__ import annotations

from edge.api.chat_request import ChatParts, call_arguments, chat_request, checked_tool, tool_spec
from edge.api.fields import ApiError, cache_salt, checked_text, get_field, nested_string, priority, show
from edge.api.generate_request import GenerateRequest
from edge.api.sampling_fields import read_sampling
from edge.api.structured import json_schema
from edge.chat.tool_formats import ChatFormat

ROLES = {"user", "assistant"}
# SamplingRequest's fields a Messages body sets (ours beside Anthropic's), under their Anthropic names
SAMPLING_NAMES = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "stop": "stop_sequences", "seed": "seed", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty"}
IGNORED_BLOCKS = {"thinking", "redacted_thinking"}  # an earlier turn's thinking: left out of the prompt


def parse_messages(body, vocab_size: int | None = None, chat: ChatFormat | None = None,
                   count_only: bool = False) -> GenerateRequest:
    """count_only: count_tokens' body, which has no max_tokens and is never streamed."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = checked_text(get_field(body, "model", str, required=True), "model")
    if not count_only:
        max_tokens = get_field(body, "max_tokens", int, required=True)
        if max_tokens < 1:
            raise ApiError(400, f"'max_tokens' must be at least 1, got {show(max_tokens)}", "max_tokens",
                           "invalid_value")
    sampling = read_sampling(body, SAMPLING_NAMES, vocab_size, temperature_high=1.0)  # Anthropic's range
    messages = _system(body) + _messages(body)
    stream = not count_only and get_field(body, "stream", bool, default=False)
    parts = ChatParts(model, messages, sampling, stream, _tools(body, chat), _output_format(body),
                      priority=priority(body), cache_salt=cache_salt(body))
    return chat_request(parts, chat)


def _system(body: dict) -> tuple[dict, ...]:
    system = body.get("system")
    return () if system is None else ({"role": "system", "content": _text(system, "system"), "tool_calls": ()},)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = get_field(body, "messages", list, required=True)
    if not messages:
        raise ApiError(400, "'messages' must hold at least one message", "messages", "invalid_value")
    out: list[dict] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ApiError(400, f"{param}.role must be user or assistant", f"{param}.role", "invalid_value")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": checked_text(content, f"{param}.content"), "tool_calls": ()})
        elif isinstance(content, list):
            out.extend(_blocks(role, content, f"{param}.content"))
        else:
            raise ApiError(400, f"{param}.content must be a string or a list of content blocks", f"{param}.content",
                           "invalid_type")
    return tuple(out)


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
            texts.append(checked_text(nested_string(block, "text", where), f"{where}.text"))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise ApiError(400, f"{where}.input must be an object", f"{where}.input", "invalid_type")
            calls.append({"name": checked_text(nested_string(block, "name", where), f"{where}.name"),
                          "arguments": call_arguments(arguments, f"{where}.input"), "id": _text_id(block, "id", where)})
        else:
            text = _text(block.get("content", ""), f"{where}.content")
            results.append({"role": "tool", "tool_call_id": _text_id(block, "tool_use_id", where), "tool_calls": (),
                            "content": f"Error: {text}" if block.get("is_error") else text})
    text = "".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text, "tool_calls": tuple(calls)}] if calls or text else []
    return results + ([{"role": "user", "content": text, "tool_calls": ()}] if texts or not results else [])


def _text_id(block: dict, name: str, where: str) -> str:
    value = block.get(name)
    return checked_text(value, f"{where}.{name}") if isinstance(value, str) else ""


def _text(content, param: str) -> str:
    """A string or a list of text blocks, joined."""
    if isinstance(content, str):
        return checked_text(content, param)
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(checked_text(b["text"], f"{param}[{j}].text") for j, b in enumerate(content))
    raise ApiError(400, f"{param} must be a string or a list of text blocks ({{\"type\": \"text\", \"text\": ...}})",
                   param, "invalid_type")


def _tools(body: dict, chat: ChatFormat | None):
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, {"type": "none"}, {"type": "auto"}):
            raise ApiError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of tools", "tools", "invalid_type")
    specs = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"tools[{i}]: only custom tools (name, description, input_schema) are supported, "
                                f"not {show(kind)} (server tools need services this server does not run)",
                           f"tools[{i}]", "unsupported_parameter")
        if not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema",
                           "invalid_value")
        specs.append(checked_tool(tool, f"tools[{i}]", "input_schema"))
    return _tool_choice(choice, specs, chat)


def _tool_choice(choice, specs: list[dict], chat: ChatFormat | None):
    """Anthropic's {"type": auto|any|tool|none, "disable_parallel_tool_use"} over the checked tools."""
    if choice is None:
        return tool_spec(specs, "auto", None, True, chat)
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use", False))
    if kind in ("auto", "none"):
        return tool_spec(specs, kind, None, parallel, chat)
    if kind == "any":
        return tool_spec(specs, "required", None, parallel, chat)
    if kind == "tool" and choice.get("name") in {t["name"] for t in specs}:
        return tool_spec(specs, "named", choice["name"], parallel, chat)
    raise ApiError(400, "tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                        "{\"type\": \"tool\", \"name\": ...} naming one of the tools", "tool_choice", "invalid_value")


def _output_format(body: dict) -> tuple[str | None, tuple[str, str] | None]:
    """output_config.format (Anthropic's structured outputs): a JSON schema the answer must fit."""
    config = get_field(body, "output_config", dict, default=None)
    fmt = (config or {}).get("format")
    if fmt is None:
        return None, None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config.format", "invalid_value")
    return "output_config.format", json_schema(fmt["schema"], "output_config.format.schema", "output_config.format")
