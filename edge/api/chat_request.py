"""The chat request every chat-shaped API builds (OpenAI chat completions, Responses, Anthropic Messages): each API's
parser reads its own body under its own field names into ChatParts, and chat_request makes the GenerateRequest from
them (the tools' prompt, the answer's grammar, the checks between fields). The pieces the parsers share are here too:
a tool's definition and an earlier call's arguments, checked and named as the client sent them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from contracts.grammar import MAX_SCHEMA_DEPTH, GrammarError, check_schema_depth, json_depth
from edge.api.fields import ApiError, checked_text
from edge.api.generate_request import GenerateRequest
from edge.api.sampling_request import SamplingRequest
from edge.chat.tool_formats import ChatFormat
from edge.chat.tools import MAX_TOOLS, NAME, ToolError, ToolSpec, answer_constraint, template_tools, with_tools

MAX_MESSAGES = 4096


@dataclass(frozen=True)
class ChatParts:
    """A chat body as its API's parser read it. messages: {"role", "content" (text), "tool_calls" ({"name",
    "arguments" (parsed when JSON), "id"}, ...), "tool_call_id" (a tool result's)}."""
    model: str
    messages: tuple[dict, ...]
    sampling: SamplingRequest  # its structured output not set yet: chat_request decides it
    stream: bool = False
    tools: ToolSpec | None = None
    structured: tuple[str | None, tuple[str, str] | None] = (None, None)  # (the field it came from, constraint)
    include_usage: bool = False
    priority: int | None = None
    cache_salt: str = ""
    chat_logprobs: bool = False
    messages_param: str = "messages"  # the API's name of the conversation's field, for errors
    history: tuple[dict, ...] = field(default=())
    store: bool = False
    previous_response_id: str | None = None


def chat_request(parts: ChatParts, chat: ChatFormat | None) -> GenerateRequest:
    """The GenerateRequest of a chat: the tools' prompt (edge.chat.tools), and the grammar the answer is held to
    (a structured output, tool calls, a reasoning model's thinking: one constraint)."""
    if len(parts.messages) > MAX_MESSAGES:
        raise ApiError(400, f"{parts.messages_param!r} may hold at most {MAX_MESSAGES} messages, got "
                            f"{len(parts.messages)}", parts.messages_param, "invalid_value")
    tools, sampling = parts.tools, parts.sampling
    param, structured = parts.structured
    if tools is not None and tools.constrained and structured is not None:
        raise ApiError(400, f"tool_choice {tools.choice!r} and {param} both constrain the answer; use one",
                       "tool_choice", "invalid_value")
    try:
        constraint = answer_constraint(structured, tools, chat)
    except ToolError as err:
        raise ApiError(400, str(err), param or err.param, "invalid_value") from None
    if constraint is not structured:  # tool calls or thinking shape the answer's grammar
        param = "tools" if tools is not None and tools.choice != "none" else param
    if constraint is not None and sampling.ignore_eos:
        raise ApiError(400, "'ignore_eos' cannot be combined with a structured output: the grammar ends the answer",
                       "ignore_eos", "invalid_value")
    messages = tuple(with_tools(list(parts.messages), tools, chat))
    return GenerateRequest(
        "chat", parts.model, dataclasses.replace(sampling, structured=constraint), parts.stream, parts.include_usage,
        parts.priority, messages=messages, chat_logprobs=parts.chat_logprobs, structured_param=param, tools=tools,
        user_text="\n".join(m["content"] for m in messages), cache_salt=parts.cache_salt, chat=chat,
        template_tools=template_tools(tools, chat), asked_logprobs=sampling.logprobs is not None,
        history=parts.history, store=parts.store, previous_response_id=parts.previous_response_id)


def tool_spec(tools: list[dict], choice: str, named: str | None, parallel: bool, chat: ChatFormat | None,
              param: str = "tools") -> ToolSpec:
    """tools: each {"name", "description", "parameters"}, checked by checked_tool; choice: none, auto, required or
    named (then named is the function)."""
    if not 1 <= len(tools) <= MAX_TOOLS:
        raise ApiError(400, f"{param} must be a list of 1 to {MAX_TOOLS} tools", param, "invalid_value")
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"{param} must have distinct names", param, "invalid_value")
    return ToolSpec(tuple(tools), choice, named, parallel, chat.tool_parser if chat is not None else "hermes")


def checked_tool(tool: dict, param: str, schema_key: str = "parameters") -> dict:
    """A flat tool definition ({"name", "description", schema_key}) as ToolSpec holds it; refusals name
    param.<key> as the client sent it."""
    name, description = tool.get("name"), tool.get("description") or ""
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiError(400, f"{param}.name must be 1-64 letters, digits, _ or -", f"{param}.name", "invalid_value")
    if not isinstance(description, str):
        raise ApiError(400, f"{param}.description must be a string", f"{param}.description", "invalid_type")
    parameters = tool.get(schema_key, {"type": "object", "properties": {}})
    where = f"{param}.{schema_key}"
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{where} must be a JSON schema object", where, "invalid_value")
    try:  # before anything recursive (json.dumps below, the call schema's rewriting) meets it
        check_schema_depth(parameters, where)
    except GrammarError as err:
        raise ApiError(400, str(err), where, err.code) from None
    try:  # the tool is rendered into the prompt, which travels as UTF-8: a lone surrogate cannot
        json.dumps([description, parameters], ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} must be valid Unicode text: it holds a lone surrogate", param,
                       "invalid_value") from None
    return {"name": name, "description": description, "parameters": parameters}


def call_arguments(arguments, param: str):
    """An earlier call's arguments: JSON text parsed (kept as sent when it is not JSON), or an object (Anthropic's
    tool_use input). They are written into the prompt with json.dumps, which recurses: nested deeper than a JSON
    schema may be (contracts.grammar.MAX_SCHEMA_DEPTH) is a 400 naming param."""
    if isinstance(arguments, str):
        checked_text(arguments, param)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # kept as the text the client sent
        except RecursionError:  # nested past the decoder's stack: the body's own depth check does not see inside
            raise _too_deep(param) from None
    if json_depth(arguments) > MAX_SCHEMA_DEPTH:
        raise _too_deep(param)
    try:  # a lone surrogate in a key or value of a parsed object cannot travel as UTF-8 either
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} must be valid Unicode text: it holds a lone surrogate", param,
                       "invalid_value") from None
    return arguments


def _too_deep(param: str) -> ApiError:
    return ApiError(400, f"{param} is JSON nested too deeply: more than {MAX_SCHEMA_DEPTH} levels of arrays and "
                         f"objects", param, "invalid_value")
