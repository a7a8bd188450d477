"""Ollama's /api/chat and /api/generate bodies read into the one internal request (edge.api.generate_request): a
chat through the shared chat builder (edge.api.chat_request), /api/generate as a chat of its system and prompt, or
with `raw` as a completion of the prompt alone. `options` map onto our sampling fields (OPTIONS), `format` onto a
structured output, `tools` onto our tool calls; every refusal names the Ollama field (options.num_predict, format,
messages[2].images)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edge.api.chat_request import ChatParts, call_arguments, chat_request
from edge.api.fields import ApiError, cache_salt, checked_text, get_field, get_int, priority, show
from edge.api.generate_request import GenerateRequest
from edge.api.sampling_fields import read_sampling
from edge.api.sampling_request import SamplingRequest
from edge.api.structured import json_schema
from edge.chat.tool_formats import ChatFormat
from edge.chat.tools import ToolError, parse_tools

# SamplingRequest's field -> the Ollama option that sets it (Ollama's names: num_predict, repeat_penalty)
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
           "max_tokens": "num_predict", "stop": "stop", "repetition_penalty": "repeat_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "min_p": "min_p"}
# options that would sample differently from anything we do: refused unless set to their neutral value
REFUSED_OPTIONS = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
# every other option (num_ctx, num_gpu, num_thread, num_batch, num_keep, repeat_last_n, use_mmap, ...) and any key
# Ollama does not know either: accepted and ignored, as Ollama ignores an option it does not know (docs/ollama.md)
ROLES = {"system", "user", "assistant", "tool"}
THINK_LEVELS = ("high", "medium", "low")  # gpt-oss' levels: any of them asks for thinking


@dataclass(frozen=True)
class OllamaRequest:
    """A parsed /api/chat or /api/generate body: the internal request and what only the Ollama answer needs."""
    request: GenerateRequest
    sent_model: str  # the name as the client sent it, echoed in every answer (Ollama echoes it too)
    think: bool | None  # None: the model's way; False: its thinking is not returned


def parse_chat(body, served, vocab_size: int | None, chat: ChatFormat | None) -> OllamaRequest:
    """served(name): the served name a client's name stands for (ours, or with Ollama's ':latest'), else None."""
    model, sent, stream, think = _common(body, served, chat)
    messages = _messages(get_field(body, "messages", list, required=True))
    tools = _tools(body, chat)
    parts = ChatParts(model, messages, _sampling(body, vocab_size), stream, tools, _format(body),
                      priority=priority(body), cache_salt=cache_salt(body))
    return OllamaRequest(chat_request(parts, chat), sent, think)


def parse_generate(body, served, vocab_size: int | None, chat: ChatFormat | None) -> OllamaRequest:
    """The prompt under the model's chat template (with `system` before it), or with `raw` the prompt alone."""
    model, sent, stream, think = _common(body, served, chat)
    for name in ("suffix", "template", "context", "images"):  # what needs a model or a template we do not have
        if body.get(name) not in (None, "", []):
            raise ApiError(400, _UNSUPPORTED[name], name, "unsupported_parameter")
    prompt = checked_text(get_field(body, "prompt", str, required=True), "prompt")
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty (an empty prompt only loads the model)", "prompt",
                       "invalid_value")
    sampling = _sampling(body, vocab_size)
    if get_field(body, "raw", bool, default=False):
        return OllamaRequest(_raw(body, model, prompt, sampling, stream), sent, think)
    system = checked_text(get_field(body, "system", str, default=""), "system")
    messages = ({"role": "system", "content": system, "tool_calls": ()},) if system else ()
    messages += ({"role": "user", "content": prompt, "tool_calls": ()},)
    parts = ChatParts(model, messages, sampling, stream, None, _format(body), priority=priority(body),
                      cache_salt=cache_salt(body), messages_param="prompt")
    return OllamaRequest(chat_request(parts, chat), sent, think)


_UNSUPPORTED = {
    "suffix": "'suffix' (fill-in-the-middle) is not supported by this server; send the prompt alone",
    "template": "'template' (an Ollama Go template) is not supported: the model's own chat template applies, or "
                "send 'raw': true with the prompt already templated",
    "context": "'context' (Ollama's deprecated token memory) is not supported: use /api/chat with the conversation's "
               "messages",
    "images": "'images' are not supported: this server serves text-only models",
}


def _raw(body: dict, model: str, prompt: str, sampling: SamplingRequest, stream: bool) -> GenerateRequest:
    if body.get("system"):
        raise ApiError(400, "raw mode does not take 'system' (the prompt is sent as it is)", "system",
                       "invalid_value")
    param, structured = _format(body)
    return GenerateRequest("completion", model, dataclasses.replace(sampling, structured=structured), stream, False,
                           priority(body), prompt, structured_param=param, user_text=prompt,
                           cache_salt=cache_salt(body), asked_logprobs=sampling.logprobs is not None)


def _common(body, served, chat: ChatFormat | None) -> tuple[str, str, bool, bool | None]:
    """(the served model's name, the name as sent, stream, think). keep_alive is the route's (edge.http.ollama),
    checked before the body comes here."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    sent = checked_text(get_field(body, "model", str, required=True), "model")
    if not sent:
        raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
    stream = get_field(body, "stream", bool, default=True)  # Ollama streams unless told not to
    return served(sent) or sent, sent, stream, _think(body, sent, chat)


def _think(body: dict, model: str, chat: ChatFormat | None) -> bool | None:
    think = body.get("think")
    if think is None:
        return None
    if not isinstance(think, bool) and think not in THINK_LEVELS:
        raise ApiError(400, f"'think' must be true, false or one of {', '.join(THINK_LEVELS)}, got {show(think)}",
                       "think", "invalid_value")
    if think is not False and (chat is None or not chat.reasoning):
        raise ApiError(400, f"{model!r} does not support thinking (its chat template has no thinking; a "
                            f"reasoning_parser may be configured for it)", "think", "invalid_value")
    return think is not False


def _sampling(body: dict, vocab_size: int | None) -> SamplingRequest:
    """options onto SamplingRequest under their Ollama names (refusals say options.<name>), and logprobs."""
    options = get_field(body, "options", dict, default={})
    for name, neutral in REFUSED_OPTIONS.items():
        if options.get(name) not in (None, neutral):
            raise ApiError(400, f"options.{name}={show(options[name])} is not supported by this server (leave it "
                                f"out or set it to {neutral!r})", f"options.{name}", "unsupported_parameter")
    flat = {f"options.{name}": options[name] for name in OPTIONS.values() if options.get(name) is not None}
    if _is_int(flat.get("options.num_predict")) and flat["options.num_predict"] < 0:
        del flat["options.num_predict"]  # -1 (no limit), -2 (fill the context): the policy's and context's limit
    if flat.get("options.seed") == -1:
        del flat["options.seed"]  # Ollama's -1: a random seed
    top = get_int(body, "top_logprobs", 0, 20, default=0)
    logprobs = top if get_field(body, "logprobs", bool, default=False) else None
    return read_sampling(flat, {field: f"options.{name}" for field, name in OPTIONS.items()}, vocab_size, logprobs)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _format(body: dict) -> tuple[str | None, tuple[str, str] | None]:
    """format: "json" (Ollama's JSON mode: a JSON object) or a JSON schema the answer must fit."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return None, None
    if fmt == "json":
        return "format", ("json_object", "")
    if isinstance(fmt, dict):
        return "format", json_schema(fmt, "format")
    raise ApiError(400, f"'format' must be \"json\" or a JSON schema object, got {show(fmt)}", "format",
                   "invalid_value")


def _tools(body: dict, chat: ChatFormat | None):
    """Ollama's tools are OpenAI's function tools; there is no tool_choice (the model decides: auto)."""
    if body.get("tools") in (None, []):
        return None
    try:
        return parse_tools({"tools": body["tools"]}, chat.tool_parser if chat is not None else "hermes")
    except ToolError as err:
        raise ApiError(400, str(err), err.param, "invalid_value") from None


def _messages(messages: list) -> tuple[dict, ...]:
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ApiError(400, f"{param}.role must be one of {', '.join(sorted(ROLES))}", f"{param}.role",
                           "invalid_value")
        if message.get("images"):
            raise ApiError(400, f"{param}.images: images are not supported (this server serves text-only models)",
                           f"{param}.images", "unsupported_parameter")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise ApiError(400, f"{param}.content must be a string", f"{param}.content", "invalid_type")
        entry = {"role": role, "content": checked_text(content, f"{param}.content"),
                 "tool_calls": _calls(message.get("tool_calls"), param) if role == "assistant" else ()}
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            entry["tool_call_id"] = checked_text(message["tool_call_id"], f"{param}.tool_call_id")
        out.append(entry)  # an assistant's earlier `thinking` is left out of the prompt, as templates leave it
    return tuple(out)


def _calls(calls, param: str) -> tuple[dict, ...]:
    """An assistant's earlier calls, Ollama's {"function": {"name", "arguments": {...}}} (arguments an object)."""
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise ApiError(400, f"{param}.tool_calls must be a list", f"{param}.tool_calls", "invalid_type")
    out = []
    for j, call in enumerate(calls):
        where = f"{param}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where} must be {{\"function\": {{\"name\": ..., \"arguments\": {{...}}}}}}", where,
                           "invalid_value")
        out.append({"name": checked_text(function["name"], f"{where}.function.name"),
                    "arguments": call_arguments(function.get("arguments", {}), f"{where}.function.arguments"),
                    "id": call["id"] if isinstance(call.get("id"), str) else ""})
    return tuple(out)
