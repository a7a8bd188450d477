"""A body's sampling fields read into a SamplingRequest, each under the name its API gives it (chat's max_tokens is
Responses' max_output_tokens, chat's stop Anthropic's stop_sequences), so that every refusal names the field as the
client sent it. An API reads only the fields it takes; the rest keep SamplingRequest's neutral defaults."""

from __future__ import annotations

from collections.abc import Mapping

from edge.api.fields import ApiError, checked_text, get_field, get_int, get_number, show
from edge.api.sampling_request import SamplingRequest

TOKEN_ID_LIMIT = 1 << 31  # without a vocabulary size: llama.cpp's llama_token is an int32_t
MAX_TOKENS_LIMIT = (1 << 31) - 1  # llama.cpp counts tokens in int32; any real context is far smaller
MAX_STOP_TOKEN_IDS = 256
MAX_N = 128  # choices per request, OpenAI's limit (the engine also needs n <= its max_num_seqs)
MIN_REPETITION_PENALTY = 0.01
MAX_LOGIT_BIAS = 1024  # entries in logit_bias (OpenAI documents no limit; this keeps a body's work bounded)
MAX_STOPS = 4
# every field read here, under its own (chat's) name
OPENAI_NAMES = {name: name for name in (
    "temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "logit_bias", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "ignore_eos", "n")}


def read_sampling(body: dict, names: Mapping[str, str], vocab_size: int | None = None, logprobs: int | None = None,
                  max_tokens_low: int = 1, temperature_high: float = 2.0) -> SamplingRequest:
    """names: SamplingRequest's field -> the body's name for it, for the fields the API takes. Every sampling field
    but the structured output (the chat builder's, once tools and reasoning are known)."""
    readers = {
        "temperature": lambda name: get_number(body, name, 0.0, temperature_high, default=1.0),
        "top_p": lambda name: get_number(body, name, 0.0, 1.0, default=1.0, open_low=True),
        "top_k": lambda name: max(0, get_int(body, name, -1, 1_000_000, default=0)),
        "seed": lambda name: get_int(body, name, -2**63, 2**63 - 1, default=None),
        "max_tokens": lambda name: _max_tokens(body, name, max_tokens_low),
        "stop": lambda name: _stop(body, name),
        "stop_token_ids": lambda name: token_ids(get_field(body, name, list, default=[]), name, vocab_size,
                                                 MAX_STOP_TOKEN_IDS),
        "logit_bias": lambda name: _logit_bias(body, name, vocab_size),
        "presence_penalty": lambda name: get_number(body, name, -2.0, 2.0, default=0.0),
        "frequency_penalty": lambda name: get_number(body, name, -2.0, 2.0, default=0.0),
        # bounded away from 0: dividing a logit by 1e-300 overflows to inf, a failed decode rather than a 400
        "repetition_penalty": lambda name: get_number(body, name, MIN_REPETITION_PENALTY, 100.0, default=1.0),
        "min_p": lambda name: get_number(body, name, 0.0, 1.0, default=0.0),
        "min_tokens": lambda name: get_int(body, name, 0, MAX_TOKENS_LIMIT, default=0),
        "ignore_eos": lambda name: get_field(body, name, bool, default=False),
        "n": lambda name: get_int(body, name, 1, MAX_N, default=1),
    }
    return SamplingRequest(logprobs=logprobs, **{field: readers[field](name) for field, name in names.items()})


def _max_tokens(body: dict, name: str, low: int) -> int | None:
    value = get_field(body, name, int, default=None)
    if value is not None and not low <= value <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"{name!r} must be between {low} and {MAX_TOKENS_LIMIT}, got {show(value)}", name,
                       "invalid_value")
    return value  # None: the policy's default applies


def _stop(body: dict, name: str) -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"{name!r} must be a non-empty string or a list of up to {MAX_STOPS} non-empty strings",
                       name, "invalid_value")
    names = [name] if isinstance(value, str) else [f"{name}[{i}]" for i in range(len(stops))]
    return tuple(checked_text(s, param) for s, param in zip(stops, names))


def _logit_bias(body: dict, name: str, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: keys are token ids written as strings, biases in [-100, 100]."""
    bias = get_field(body, name, dict, default={})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"{name!r} may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", name,
                       "invalid_value")
    pairs = []
    for key, value in bias.items():
        param = f"{name}[{show(key)}]"
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"{param}: the keys of {name!r} must be token ids (integers as strings)", param,
                           "invalid_value") from None
        check_token_id(token, param, vocab_size)
        pairs.append((token, get_number({param: value}, param, -100.0, 100.0, default=0.0)))
    return tuple(pairs)


def token_ids(values: list, name: str, vocab_size: int | None, max_count: int | None = None) -> tuple[int, ...]:
    if max_count is not None and len(values) > max_count:
        raise ApiError(400, f"{name!r} may hold at most {max_count} token ids, got {len(values)}", name,
                       "invalid_value")
    for i, token in enumerate(values):
        if not isinstance(token, int) or isinstance(token, bool):
            raise ApiError(400, f"{name}[{i}] must be an integer token id, not {type(token).__name__}",
                           f"{name}[{i}]", "invalid_type")
        check_token_id(token, f"{name}[{i}]", vocab_size)
    return tuple(values)


def check_token_id(token: int, param: str, vocab_size: int | None) -> None:
    limit = vocab_size if vocab_size is not None else TOKEN_ID_LIMIT
    if not 0 <= token < limit:
        known = f"the vocabulary has {vocab_size} tokens" if vocab_size is not None else "token ids are 32-bit"
        raise ApiError(400, f"{param} is {show(token)}, not a token id: ids run from 0 to {limit - 1} ({known})",
                       param, "invalid_value")
