"""Validation of OpenAI request bodies into one internal request (its field checks: edge.api.fields)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from edge.api.fields import ApiError, checked_text, get_field, get_int, get_number, show
from edge.api.sampling_request import SamplingRequest
from edge.api.structured import structured_constraint
from edge.chat.reasoning import MAX_REASONING_TOKENS_REFUSAL
from edge.chat.tool_formats import ChatFormat
from edge.chat.tools import ToolError, ToolSpec, answer_constraint, parse_tools, template_tools, with_tools

ROLES = {"system", "user", "assistant", "developer", "tool"}
UNSUPPORTED_IF_SET = {"best_of": 1, "suffix": None, "functions": None, "function_call": None}
TOKEN_ID_LIMIT = 1 << 31  # without a vocabulary size: llama.cpp's llama_token is an int32_t
MAX_TOKENS_LIMIT = (1 << 31) - 1  # llama.cpp counts tokens in int32; any real context is far smaller
MAX_MESSAGES = 4096
MAX_STOP_TOKEN_IDS = 256
MAX_N = 128  # choices per request, OpenAI's limit (the engine also needs n <= its max_num_seqs)
MAX_CACHE_SALT_CHARS = 256
MIN_REPETITION_PENALTY = 0.01
MAX_LOGIT_BIAS = 1024  # entries in logit_bias (OpenAI documents no limit; this keeps a body's work bounded)


@dataclass(frozen=True)
class GenerateRequest:
    kind: str  # "chat" or "completion"
    model: str
    sampling: SamplingRequest  # max_tokens None until the policy decides
    stream: bool
    include_usage: bool
    priority: int | None  # None: the API key's default
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    chat_logprobs: bool = False  # chat: logprobs as objects; completions: as parallel lists
    echo: bool = False  # completions: the answer starts with the prompt text
    structured_param: str | None = None  # the field a structured-output constraint came from (for errors)
    tools: ToolSpec | None = None  # chat: the tools and tool_choice
    user_text: str = ""  # every piece of client text, for content filters
    cache_salt: str = ""  # the client's own cache salt (vLLM's field); the gateway mixes it with the key's
    prompt_logprobs: int | None = None  # completions: every prompt token's logprob and this many top alternatives
    embed_texts: tuple[str, ...] = ()  # kind "embedding": the inputs as text, or
    embed_tokens: tuple[tuple[int, ...], ...] = ()  # ... as token ids
    chat: ChatFormat | None = None  # chat: the model's template (tool-call format, reasoning), edge.chat.tool_formats
    template_tools: str = ""  # chat: the tools as JSON text, for a template that renders them itself
    asked_logprobs: bool = False  # the client asked for logprobs (a degradation tier may have taken them away)


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
    tools = None
    if kind == "chat":
        try:
            tools = parse_tools(body, chat.tool_parser if chat is not None else "hermes")
        except ToolError as err:
            raise ApiError(400, str(err), err.param, "invalid_value") from None
        messages, prompt, prompt_tokens = tuple(with_tools(list(_messages(body)), tools, chat)), None, None
        chat_logprobs = get_field(body, "logprobs", bool, default=False)
        top = get_int(body, "top_logprobs", 0, 20, default=0)
        logprobs = top if chat_logprobs else None
        text = "\n".join(m["content"] for m in messages)
    else:
        messages, chat_logprobs = None, False
        prompt, prompt_tokens = _prompt(body, vocab_size)
        logprobs = get_int(body, "logprobs", 0, 20, default=None)
        text = prompt or ""
    echo = _echo(body, kind, prompt, logprobs)
    prompt_logprobs = _prompt_logprobs(body, kind, echo, logprobs)
    sampling = _sampling(body, kind, logprobs, vocab_size)
    if sampling.max_tokens == 0 and sampling.n > 1:
        raise ApiError(400, "'max_tokens' 0 computes the prompt alone, once: n must be 1", "n", "invalid_value")
    param, structured = structured_constraint(body)
    if tools is not None and tools.constrained:
        if structured is not None:
            raise ApiError(400, f"tool_choice {tools.choice!r} and {param} both constrain the answer; use one",
                           "tool_choice", "invalid_value")
    elif kind != "chat" and body.get("tools") is not None:
        raise ApiError(400, "tools are a chat completions parameter", "tools", "unsupported_parameter")
    if body.get("max_reasoning_tokens") is not None:
        raise ApiError(400, MAX_REASONING_TOKENS_REFUSAL, "max_reasoning_tokens", "unsupported_parameter")
    if kind == "chat":  # tool calls and a reasoning model's thinking shape the answer's grammar
        try:
            constraint = answer_constraint(structured, tools, chat)
        except ToolError as err:
            raise ApiError(400, str(err), param or err.param, "invalid_value") from None
        if constraint is not structured:
            param = "tools" if tools is not None and tools.choice != "none" else param
            structured = constraint
    if structured is not None and sampling.ignore_eos:
        raise ApiError(400, "'ignore_eos' cannot be combined with a structured output: the grammar ends the answer",
                       "ignore_eos", "invalid_value")
    priority = get_int(body, "priority", -1_000_000, 1_000_000, default=None)
    sampling = dataclasses.replace(sampling, structured=structured)
    return GenerateRequest(kind, model, sampling, stream, include_usage, priority, prompt, prompt_tokens, messages,
                           chat_logprobs, echo, param, tools, text, _cache_salt(body), prompt_logprobs, chat=chat,
                           template_tools=template_tools(tools, chat), asked_logprobs=logprobs is not None)


def _cache_salt(body: dict) -> str:
    salt = checked_text(get_field(body, "cache_salt", str, default=""), "cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"'cache_salt' may hold at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}",
                       "cache_salt", "invalid_value")
    return salt


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


def _sampling(body: dict, kind: str, logprobs: int | None, vocab_size: int | None) -> SamplingRequest:
    """Every sampling field but the structured output (the caller's, once tools and reasoning are known)."""
    return SamplingRequest(
        temperature=get_number(body, "temperature", 0.0, 2.0, default=1.0),
        top_p=get_number(body, "top_p", 0.0, 1.0, default=1.0, open_low=True),
        top_k=max(0, get_int(body, "top_k", -1, 1_000_000, default=0)),
        seed=get_int(body, "seed", -2**63, 2**63 - 1, default=None),
        max_tokens=_max_tokens(body, kind),
        stop=_stop(body),
        stop_token_ids=_token_ids(get_field(body, "stop_token_ids", list, default=[]), "stop_token_ids", vocab_size,
                                  MAX_STOP_TOKEN_IDS),
        logprobs=logprobs,
        logit_bias=_logit_bias(body, vocab_size),
        presence_penalty=get_number(body, "presence_penalty", -2.0, 2.0, default=0.0),
        frequency_penalty=get_number(body, "frequency_penalty", -2.0, 2.0, default=0.0),
        # bounded away from 0: dividing a logit by 1e-300 overflows to inf, a failed decode rather than a 400
        repetition_penalty=get_number(body, "repetition_penalty", MIN_REPETITION_PENALTY, 100.0, default=1.0),
        min_p=get_number(body, "min_p", 0.0, 1.0, default=0.0),
        min_tokens=get_int(body, "min_tokens", 0, MAX_TOKENS_LIMIT, default=0),
        ignore_eos=get_field(body, "ignore_eos", bool, default=False),
        n=get_int(body, "n", 1, MAX_N, default=1),
    )


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: keys are token ids written as strings, biases in [-100, 100]."""
    bias = get_field(body, "logit_bias", dict, default={})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
                       "logit_bias", "invalid_value")
    pairs = []
    for key, value in bias.items():
        param = f"logit_bias[{show(key)}]"
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"{param}: the keys of 'logit_bias' must be token ids (integers as strings)", param,
                           "invalid_value") from None
        _check_token_id(token, param, vocab_size)
        pairs.append((token, get_number({param: value}, param, -100.0, 100.0, default=0.0)))
    return tuple(pairs)


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED_IF_SET.items():
        value = body.get(name, neutral)
        if name == "best_of" and value == body.get("n", 1):
            continue  # best_of = n keeps every candidate: what n alone does
        if value not in (neutral, None):
            raise ApiError(400, f"{name}={show(value)} is not supported by this server (leave it out"
                                f"{'' if neutral is None else f' or set it to {neutral!r}'})", name,
                           "unsupported_parameter")


def _max_tokens(body: dict, kind: str) -> int | None:
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = get_field(body, name, int, default=None)
    low = 1 if kind == "chat" else 0  # a completion of max_tokens 0 scores its prompt (echo, prompt_logprobs)
    if value is not None and not low <= value <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"{name!r} must be between {low} and {MAX_TOKENS_LIMIT}, got {show(value)}", name,
                       "invalid_value")
    return value  # None: the policy's default applies


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop",
                       "invalid_value")
    names = ["stop"] if isinstance(value, str) else [f"stop[{i}]" for i in range(len(stops))]
    return tuple(checked_text(s, name) for s, name in zip(stops, names))


def _token_ids(values: list, name: str, vocab_size: int | None, max_count: int | None = None) -> tuple[int, ...]:
    if max_count is not None and len(values) > max_count:
        raise ApiError(400, f"{name!r} may hold at most {max_count} token ids, got {len(values)}", name,
                       "invalid_value")
    for i, token in enumerate(values):
        if not isinstance(token, int) or isinstance(token, bool):
            raise ApiError(400, f"{name}[{i}] must be an integer token id, not {type(token).__name__}",
                           f"{name}[{i}]", "invalid_type")
        _check_token_id(token, f"{name}[{i}]", vocab_size)
    return tuple(values)


def _check_token_id(token: int, param: str, vocab_size: int | None) -> None:
    limit = vocab_size if vocab_size is not None else TOKEN_ID_LIMIT
    if not 0 <= token < limit:
        known = f"the vocabulary has {vocab_size} tokens" if vocab_size is not None else "token ids are 32-bit"
        raise ApiError(400, f"{param} is {show(token)}, not a token id: ids run from 0 to {limit - 1} ({known})",
                       param, "invalid_value")


def _prompt(body: dict, vocab_size: int | None) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return _prompt_text(prompt[0], "prompt[0]"), None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0] \
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt[0]):  # a batch of one, as lm-eval
        return None, _token_ids(prompt[0], "prompt[0]", vocab_size)
    if isinstance(prompt, str):
        return _prompt_text(prompt, "prompt"), None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, _token_ids(prompt, "prompt", vocab_size)
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
        arguments = checked_text(function.get("arguments", "{}"), f"{param}[{j}].function.arguments")
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as the text the client sent
        except RecursionError:  # nested past the decoder's stack: the body's own depth check does not see inside
            raise ApiError(400, f"{param}[{j}].function.arguments is JSON nested too deeply",
                           f"{param}[{j}].function.arguments", "invalid_value") from None
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
