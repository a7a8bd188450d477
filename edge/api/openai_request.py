"""OpenAI's request bodies (chat completions, completions) read into the one internal request: a chat through the
shared chat builder (edge.api.chat_request), a completion here; each field's checks in edge.api.fields and
edge.api.sampling_fields."""

from __future__ import annotations

import dataclasses

from edge.api.chat_request import MAX_MESSAGES, ChatParts, call_arguments, chat_request
from edge.api.fields import ApiError, cache_salt, checked_text, get_field, get_int, priority, show
from edge.api.generate_request import GenerateRequest
from edge.api.sampling_fields import MAX_STOP_TOKEN_IDS, OPENAI_NAMES, read_sampling, token_ids
from edge.api.structured import structured_constraint
from edge.chat.reasoning import MAX_REASONING_TOKENS_REFUSAL
from edge.chat.tool_formats import ChatFormat
from edge.chat.tools import ToolError, parse_tools

__all__ = ["MAX_MESSAGES", "MAX_STOP_TOKEN_IDS", "ApiError", "GenerateRequest", "parse_request"]
ROLES = {"system", "user", "assistant", "developer", "tool"}
UNSUPPORTED_IF_SET = {"best_of": 1, "suffix": None, "functions": None, "function_call": None}


def parse_request(body, kind: str, *, vocab_size: int | None = None,
                  chat: ChatFormat | None = None) -> GenerateRequest:
    """Types and ranges only; what a client may ask for (models, token limits) is the policy's call.
    Every value that goes on the wire to a prefill worker is checked here, so that msgpack and the worker
    never meet one they cannot take. vocab_size: the model's, once known (None skips that token id check)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = checked_text(get_field(body, "model", str, required=True), "model")
    _refuse_unsupported(body)
    stream = get_field(body, "stream", bool, default=False)
    stream_options = get_field(body, "stream_options", dict, default=None)
    if stream_options is not None and not stream:  # as OpenAI and vLLM: the options of a stream need a stream
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options",
                       "invalid_value")
    include_usage = bool((stream_options or {}).get("include_usage", False))
    if body.get("max_reasoning_tokens") is not None:
        raise ApiError(400, MAX_REASONING_TOKENS_REFUSAL, "max_reasoning_tokens", "unsupported_parameter")
    rank = priority(body)
    if kind == "chat":
        return _chat(body, model, stream, include_usage, rank, vocab_size, chat)
    return _completion(body, model, stream, include_usage, rank, vocab_size)


def _chat(body: dict, model: str, stream: bool, include_usage: bool, rank: int | None, vocab_size: int | None,
          chat: ChatFormat | None) -> GenerateRequest:
    try:
        tools = parse_tools(body, chat.tool_parser if chat is not None else "hermes")
    except ToolError as err:
        raise ApiError(400, str(err), err.param, "invalid_value") from None
    messages = _messages(body)
    chat_logprobs = get_field(body, "logprobs", bool, default=False)
    top = get_int(body, "top_logprobs", 0, 20, default=0)
    _echo(body, "chat", None, None)
    _prompt_logprobs(body, "chat", False, None)
    names = {**OPENAI_NAMES, "max_tokens": "max_completion_tokens" if body.get("max_completion_tokens") is not None
             else "max_tokens"}
    sampling = read_sampling(body, names, vocab_size, top if chat_logprobs else None)
    return chat_request(ChatParts(model, messages, sampling, stream, tools, structured_constraint(body), include_usage,
                                  rank, cache_salt(body), chat_logprobs), chat)


def _completion(body: dict, model: str, stream: bool, include_usage: bool, rank: int | None,
                vocab_size: int | None) -> GenerateRequest:
    prompt, prompt_tokens = _prompt(body, vocab_size)
    logprobs = get_int(body, "logprobs", 0, 20, default=None)
    echo = _echo(body, "completion", prompt, logprobs)
    prompt_logprobs = _prompt_logprobs(body, "completion", echo, logprobs)
    sampling = read_sampling(body, OPENAI_NAMES, vocab_size, logprobs, max_tokens_low=0)
    if sampling.max_tokens == 0 and sampling.n > 1:
        raise ApiError(400, "'max_tokens' 0 computes the prompt alone, once: n must be 1", "n", "invalid_value")
    param, structured = structured_constraint(body)
    if body.get("tools") is not None:
        raise ApiError(400, "tools are a chat completions parameter", "tools", "unsupported_parameter")
    if structured is not None and sampling.ignore_eos:
        raise ApiError(400, "'ignore_eos' cannot be combined with a structured output: the grammar ends the answer",
                       "ignore_eos", "invalid_value")
    sampling = dataclasses.replace(sampling, structured=structured)
    return GenerateRequest("completion", model, sampling, stream, include_usage, rank, prompt, prompt_tokens,
                           echo=echo, structured_param=param, user_text=prompt or "", cache_salt=cache_salt(body),
                           prompt_logprobs=prompt_logprobs, asked_logprobs=logprobs is not None)


def _echo(body: dict, kind: str, prompt: str | None, logprobs: int | None) -> bool:
    """Completions may echo a text prompt; what this server cannot echo is refused, not ignored."""
    echo = get_field(body, "echo", bool, default=False)
    if not echo:
        return False
    if kind == "chat":
        raise ApiError(400, "'echo' is a completions parameter; chat completions do not take it", "echo",
                       "unsupported_parameter")
    if prompt is None and logprobs is None:
        raise ApiError(400, "'echo' of a prompt of token ids needs 'logprobs' (the prompt's tokens then come back "
                            "with their text); or send the prompt as text", "echo", "unsupported_parameter")
    return True


def _prompt_logprobs(body: dict, kind: str, echo: bool, logprobs: int | None) -> int | None:
    """How many top alternatives each prompt token is reported with (None: the prompt is not scored): vLLM's
    `prompt_logprobs`, or a completion's `echo` with `logprobs` (OpenAI's way, which lm-eval uses)."""
    value = get_int(body, "prompt_logprobs", 0, 20, default=None)
    if value is not None and kind == "chat":
        raise ApiError(400, "'prompt_logprobs' is a completions parameter here", "prompt_logprobs",
                       "unsupported_parameter")
    if echo and logprobs is not None:
        return max(logprobs, value or 0)
    return value


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED_IF_SET.items():
        value = body.get(name, neutral)
        if name == "best_of" and value == body.get("n", 1):
            continue  # best_of = n keeps every candidate: what n alone does
        if value not in (neutral, None):
            raise ApiError(400, f"{name}={show(value)} is not supported by this server (leave it out"
                                f"{'' if neutral is None else f' or set it to {neutral!r}'})", name,
                           "unsupported_parameter")


def _prompt(body: dict, vocab_size: int | None) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return _prompt_text(prompt[0], "prompt[0]"), None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0] \
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt[0]):  # a batch of one, as lm-eval
        return None, token_ids(prompt[0], "prompt[0]", vocab_size)
    if isinstance(prompt, str):
        return _prompt_text(prompt, "prompt"), None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, token_ids(prompt, "prompt", vocab_size)
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"'prompt' holds a batch of {len(prompt)} prompts; this server takes one prompt per "
                            "request (a string, a list of token ids, or a list of one of them): send the prompts "
                            "as separate requests", "prompt", "unsupported_parameter")
    raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids", "prompt",
                   "invalid_type")


def _prompt_text(prompt: str, param: str) -> str:
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", param, "invalid_value")
    return checked_text(prompt, param)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = get_field(body, "messages", list, required=True)
    if not 1 <= len(messages) <= MAX_MESSAGES:
        raise ApiError(400, f"'messages' must hold 1 to {MAX_MESSAGES} messages, got {len(messages)}", "messages",
                       "invalid_value")
    clean = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role in {sorted(ROLES)}", f"messages[{i}]",
                           "invalid_value")
        calls = _tool_calls(message.get("tool_calls"), i) if role == "assistant" else ()
        content = message.get("content")
        text = "" if content is None and (calls or role == "assistant") else _content_text(content, i)
        entry = {"role": role, "content": text, "tool_calls": calls}
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            entry["tool_call_id"] = checked_text(message["tool_call_id"], f"messages[{i}].tool_call_id")
        clean.append(entry)
    return tuple(clean)


def _tool_calls(calls, index: int) -> tuple[dict, ...]:
    """An assistant message's earlier tool calls, as {"name", "arguments"} (arguments parsed when JSON)."""
    if calls is None:
        return ()
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{param} must be a list", param, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", "{}"), str):
            raise ApiError(400, f"{param}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"arguments\": <JSON text>}}}}", f"{param}[{j}]", "invalid_value")
        arguments = call_arguments(function.get("arguments", "{}"), f"{param}[{j}].function.arguments")
        out.append({"name": checked_text(function["name"], f"{param}[{j}].function.name"), "arguments": arguments,
                    "id": checked_text(call["id"], f"{param}[{j}].id") if isinstance(call.get("id"), str) else ""})
    return tuple(out)


def _content_text(content, index: int) -> str:
    """A string, or a flat list of text parts; nothing deeper is looked into."""
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return checked_text(content, param)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(checked_text(p["text"], f"{param}[{j}].text") for j, p in enumerate(content))
    raise ApiError(400, f"{param} must be a string or a list of text parts ({{\"type\": \"text\", \"text\": ...}})",
                   param, "invalid_type")
