"""Validation of OpenAI request bodies into one internal request, and OpenAI-style error bodies."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from aiohttp import web

from edge.tools import ToolError, ToolSpec, parse_tools, with_tools

ROLES = {"system", "user", "assistant", "developer", "tool"}
UNSUPPORTED_IF_SET = {"best_of": 1, "suffix": None, "functions": None, "function_call": None}
TOKEN_ID_LIMIT = 1 << 31  # without a vocabulary size: llama.cpp's llama_token is an int32_t
MAX_TOKENS_LIMIT = (1 << 31) - 1  # llama.cpp counts tokens in int32; any real context is far smaller
MAX_MESSAGES = 4096
MAX_STOP_TOKEN_IDS = 256
MAX_N = 128  # choices per request, OpenAI's limit (the engine also needs n <= its max_num_seqs)
MAX_LOGIT_BIAS = 1024  # entries in logit_bias (OpenAI documents no limit; this keeps a body's work bounded)


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
    sampling: dict  # contracts.handoff.SamplingParams fields (max_tokens None until the policy decides)
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


def parse_request(body, kind: str, *, vocab_size: int | None = None) -> GenerateRequest:
    """Types and ranges only; what a client may ask for (models, token limits) is the policy's call.
    Every value that goes on the wire to a prefill worker is checked here, so that msgpack and the worker
    never meet one they cannot take. vocab_size: the model's, once known (None skips that token id check)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _text(_field(body, "model", str, required=True), "model")
    _refuse_unsupported(body)
    stream = _field(body, "stream", bool, default=False)
    stream_options = _field(body, "stream_options", dict, default=None) or {}
    include_usage = bool(stream_options.get("include_usage", False))
    tools = None
    if kind == "chat":
        try:
            tools = parse_tools(body)
        except ToolError as err:
            raise ApiError(400, str(err), err.param, "invalid_value") from None
        messages, prompt, prompt_tokens = tuple(with_tools(list(_messages(body)), tools)), None, None
        chat_logprobs = _field(body, "logprobs", bool, default=False)
        top = _int(body, "top_logprobs", 0, 20, default=0)
        logprobs = top if chat_logprobs else None
        text = "\n".join(m["content"] for m in messages)
    else:
        messages, chat_logprobs = None, False
        prompt, prompt_tokens = _prompt(body, vocab_size)
        logprobs = _int(body, "logprobs", 0, 20, default=None)
        text = prompt or ""
    echo = _echo(body, kind, prompt, logprobs)
    sampling = _sampling(body, kind, logprobs, vocab_size)
    param, sampling["structured"] = _structured(body)
    if tools is not None and tools.constrained:
        if sampling["structured"] is not None:
            raise ApiError(400, f"tool_choice {tools.choice!r} and {param} both constrain the answer; use one",
                           "tool_choice", "invalid_value")
        param, sampling["structured"] = "tools", tools.constraint()
    elif kind != "chat" and body.get("tools") is not None:
        raise ApiError(400, "tools are a chat completions parameter", "tools", "unsupported_parameter")
    if sampling["structured"] is not None and sampling["ignore_eos"]:
        raise ApiError(400, "'ignore_eos' cannot be combined with a structured output: the grammar ends the answer",
                       "ignore_eos", "invalid_value")
    priority = _int(body, "priority", -1_000_000, 1_000_000, default=None)
    return GenerateRequest(kind, model, sampling, stream, include_usage, priority, prompt,
                           prompt_tokens, messages, chat_logprobs, echo, param, tools, text)


_GRAMMAR_CHECKS: dict = {}  # model path -> contracts.grammar_compile.GatewayCheck, made on its first constraint


async def check_structured(request: GenerateRequest, timeout_s: float | None = None,
                           model_path: str | None = None) -> None:
    """A constraint the engine cannot enforce is the client's 400 naming the problem (code
    invalid_structured_output), one too large or too slow to compile a 400 too (code structured_output_too_complex),
    and a full compile pool a 503. The constraint is compiled as the prefill workers will compile it, over the
    model's vocabulary (the GGUF at model_path, its tokenizer only), in a bounded pool off the event loop, and
    awaited at most timeout_s (grammar_compile_timeout_s)."""
    constraint = request.sampling.get("structured")
    if constraint is None:
        return
    from contracts.grammar import GrammarBusyError, GrammarError
    from contracts.grammar_compile import GatewayCheck, compile_timeout_s
    check = _GRAMMAR_CHECKS.get(model_path)
    if check is None:
        check = _GRAMMAR_CHECKS[model_path] = GatewayCheck(_vocabulary(model_path) if model_path else None)
    try:
        await check.check(*constraint, timeout_s or compile_timeout_s())
    except GrammarBusyError as err:
        raise ApiError(503, str(err), request.structured_param, err.code, "server_error",
                       {"Retry-After": "1"}) from None
    except GrammarError as err:
        raise ApiError(400, str(err), request.structured_param, err.code) from None


def _vocabulary(model_path: str):
    def load():
        from prefill_cpu.grammar import GGUFVocabulary
        return GGUFVocabulary(model_path)
    return load


def _structured(body: dict) -> tuple[str | None, tuple[str, str] | None]:
    """(the field it came from, (kind, source)) of a structured-output constraint, or (None, None). OpenAI's
    response_format, vLLM's guided_* fields and its structured_outputs object; at most one constraint. Whether
    it compiles is checked by the caller (check_structured, off the event loop)."""
    found: list[tuple[str, tuple[str, str]]] = []
    response_format = _field(body, "response_format", dict, default=None)
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            found.append(("response_format", ("json_object", "")))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                               "response_format", "invalid_value")
            found.append(("response_format", ("json_schema", json.dumps(schema))))
        elif kind != "text":
            raise ApiError(400, f"response_format.type must be text, json_object or json_schema, not "
                                f"{_show(kind)}", "response_format", "invalid_value")
    sources = {f"guided_{name}": body.get(f"guided_{name}") for name in ("json", "regex", "choice", "grammar")}
    outputs = _field(body, "structured_outputs", dict, default={})
    sources.update({f"structured_outputs.{name}": outputs.get(name) for name in ("json", "regex", "choice", "grammar")})
    for param, value in sources.items():
        if value is not None:
            found.append((param, _guided(param, value)))
    if len(found) > 1:
        raise ApiError(400, f"one structured output per request, got {', '.join(p for p, _ in found)}", found[1][0],
                       "invalid_value")
    return found[0] if found else (None, None)


def _guided(param: str, value) -> tuple[str, str]:
    kind = param.rsplit("_", 1)[-1].rsplit(".", 1)[-1]
    if kind == "json":
        if isinstance(value, str):
            return "json_schema", value
        if isinstance(value, dict):
            return "json_schema", json.dumps(value)
        raise ApiError(400, f"{param} must be a JSON schema (an object or its JSON text)", param, "invalid_type")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, f"{param} must be a non-empty list of non-empty strings", param, "invalid_value")
        return "choice", json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param, "invalid_type")
    return kind, _text(value, param)


def _echo(body: dict, kind: str, prompt: str | None, logprobs: int | None) -> bool:
    """Completions may echo a text prompt; what this server cannot echo is refused, not ignored."""
    echo = _field(body, "echo", bool, default=False)
    if not echo:
        return False
    if kind == "chat":
        raise ApiError(400, "'echo' is a completions parameter; chat completions do not take it", "echo",
                       "unsupported_parameter")
    if prompt is None:
        raise ApiError(400, "'echo' needs a text prompt here (a prompt of token ids is not echoed)", "echo",
                       "unsupported_parameter")
    if logprobs is not None:
        raise ApiError(400, "'echo' with 'logprobs' is not supported: this server does not compute the prompt's "
                            "logprobs", "echo", "unsupported_parameter")
    return True


def _sampling(body: dict, kind: str, logprobs: int | None, vocab_size: int | None) -> dict:
    return {
        "temperature": _number(body, "temperature", 0.0, 2.0, default=1.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, default=1.0, open_low=True),
        "top_k": max(0, _int(body, "top_k", -1, 1_000_000, default=0)),
        "seed": _int(body, "seed", -2**63, 2**63 - 1, default=None),
        "max_tokens": _max_tokens(body, kind),
        "stop": _stop(body),
        "stop_token_ids": _token_ids(_field(body, "stop_token_ids", list, default=[]), "stop_token_ids",
                                     vocab_size, MAX_STOP_TOKEN_IDS),
        "logprobs": logprobs,
        "logit_bias": _logit_bias(body, vocab_size),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0, default=0.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0, default=0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0, 100.0, default=1.0, open_low=True),
        "min_p": _number(body, "min_p", 0.0, 1.0, default=0.0),
        "min_tokens": _int(body, "min_tokens", 0, MAX_TOKENS_LIMIT, default=0),
        "ignore_eos": _field(body, "ignore_eos", bool, default=False),
        "n": _int(body, "n", 1, MAX_N, default=1),
    }


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: keys are token ids written as strings, biases in [-100, 100]."""
    bias = _field(body, "logit_bias", dict, default={})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
                       "logit_bias", "invalid_value")
    pairs = []
    for key, value in bias.items():
        param = f"logit_bias[{_show(key)}]"
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"{param}: the keys of 'logit_bias' must be token ids (integers as strings)", param,
                           "invalid_value") from None
        _check_token_id(token, param, vocab_size)
        pairs.append((token, _number({param: value}, param, -100.0, 100.0, default=0.0)))
    return tuple(pairs)


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED_IF_SET.items():
        value = body.get(name, neutral)
        if name == "best_of" and value == body.get("n", 1):
            continue  # best_of = n keeps every candidate: what n alone does
        if value not in (neutral, None):
            raise ApiError(400, f"{name}={_show(value)} is not supported by this server (leave it out"
                                f"{'' if neutral is None else f' or set it to {neutral!r}'})", name,
                           "unsupported_parameter")


def _show(value) -> str:
    """A short rendering of a client value for an error message: never the repr of a whole nested body."""
    if isinstance(value, (list, dict)):
        return f"<a JSON {'array' if isinstance(value, list) else 'object'}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value: str, param: str) -> str:
    """msgpack sends str as UTF-8, which has no encoding for a lone surrogate (JSON's "\\ud800"): the send to
    a prefill worker would fail and stall it, so such text stops here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{param} must be valid Unicode text: it holds a lone surrogate "
                            f"U+{ord(value[err.start]):04X} at character {err.start}", param, "invalid_value") from None
    return value


def _field(body: dict, name: str, kind, required: bool = False, default=None):
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"{name!r} is required", name, "missing_required_parameter")
        return default
    value = body[name]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = kind.__name__ if isinstance(kind, type) else "number"
        raise ApiError(400, f"{name!r} must be of type {expected}, not {type(value).__name__}", name, "invalid_type")
    return value


def _int(body: dict, name: str, low: int, high: int, default):
    value = _field(body, name, int, default=default)
    if value is not default and not low <= value <= high:
        raise ApiError(400, f"{name!r} must be between {low} and {high}, got {_show(value)}", name, "invalid_value")
    return value


def _number(body: dict, name: str, low: float, high: float, default: float, open_low: bool = False) -> float:
    value = _field(body, name, (int, float), default=default)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float: refused below like infinity
        value = math.inf
    if not math.isfinite(value) or value > high or value < low or (open_low and value == low):
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ApiError(400, f"{name!r} must be in {bound}, got {value}", name, "invalid_value")
    return value


def _max_tokens(body: dict, kind: str) -> int | None:
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = _field(body, name, int, default=None)
    if value is not None and not 1 <= value <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"{name!r} must be between 1 and {MAX_TOKENS_LIMIT}, got {_show(value)}", name,
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
    return tuple(_text(s, name) for s, name in zip(stops, names))


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
        raise ApiError(400, f"{param} is {_show(token)}, not a token id: ids run from 0 to {limit - 1} ({known})",
                       param, "invalid_value")


def _prompt(body: dict, vocab_size: int | None) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return _prompt_text(prompt[0], "prompt[0]"), None
    if isinstance(prompt, str):
        return _prompt_text(prompt, "prompt"), None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, _token_ids(prompt, "prompt", vocab_size)
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt", "missing_required_parameter")
    raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids", "prompt",
                   "invalid_type")


def _prompt_text(prompt: str, param: str) -> str:
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", param, "invalid_value")
    return _text(prompt, param)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = _field(body, "messages", list, required=True)
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
        clean.append({"role": role, "content": text, "tool_calls": calls})
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
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as the text the client sent
        out.append({"name": _text(function["name"], f"{param}[{j}].function.name"), "arguments": arguments})
    return tuple(out)


def _content_text(content, index: int) -> str:
    """A string, or a flat list of text parts; nothing deeper is looked into."""
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return _text(content, param)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(_text(p["text"], f"{param}[{j}].text") for j, p in enumerate(content))
    raise ApiError(400, f"{param} must be a string or a list of text parts ({{\"type\": \"text\", \"text\": ...}})",
                   param, "invalid_type")
