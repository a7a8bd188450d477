"""POST /api/chat and /api/generate (Ollama's API) on the gateway's one generate path (edge.http.generate): the body
read by edge.api.ollama_request, the answer (edge.api.completion) rendered as Ollama's objects, streamed as NDJSON
the way Ollama streams (one JSON object per line: `done: false` chunks, then one `done: true` object with
done_reason and the durations in nanoseconds), every error in Ollama's shape ({"error": "..."}).

One OllamaApi per request: it keeps what the answer echoes (the model's name as sent, `think`) and when the request
came in (total_duration counts from there, as Ollama's does)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime

from aiohttp import web

from edge.api.client_api import ClientApi, StreamWriter
from edge.api.completion import ChoiceDelta, Completion
from edge.api.fields import ApiError
from edge.api.generate_request import GenerateRequest
from edge.api.ollama_request import OllamaRequest, parse_chat, parse_generate
from edge.api.openai_bodies import spoken

NS = 1_000_000_000
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}  # Ollama says stop after tool calls


def error_response(err: ApiError) -> web.Response:
    """An ApiError in Ollama's shape, with its status (and headers: Retry-After, ...)."""
    return web.json_response({"error": err.message}, status=err.status, headers=err.headers)


def error_line(err: ApiError) -> bytes:
    """An error after the stream's headers went out: one more line, as Ollama sends it; then the stream ends."""
    return ndjson({"error": err.message})


def ndjson(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def created_at() -> str:
    """Ollama's created_at: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class OllamaApi(ClientApi):
    """resolve(name): the served name a client's name stands for (ours, or with Ollama's ':latest'), else None;
    inflight(request_id): the request's edge.core.lifecycle.InFlight while it runs (its timestamps make the
    durations), from the gateway that serves it (edge.http.ollama)."""
    kind = "chat"

    def __init__(self, resolve: Callable[[str], str | None], inflight: Callable[[str], object | None]) -> None:
        self.resolve, self.inflight = resolve, inflight
        self.started = time.perf_counter()
        self.parsed: OllamaRequest | None = None

    def parse(self, body, vocab_size: int | None, chat=None, earlier: tuple[dict, ...] = ()) -> GenerateRequest:
        parse = parse_chat if self.kind == "chat" else parse_generate
        self.parsed = parse(body, self.resolve, vocab_size, chat)
        return self.parsed.request

    def error(self, err: ApiError) -> web.Response:
        return error_response(err)

    def body(self, completion: Completion) -> dict:
        message, reason = completion.message(completion.choices[0])
        choice = completion.choices[0]
        entries = spoken(choice.logprobs, "".join(choice.text)) if choice.finish_reason == "stop" else choice.logprobs
        return {**self._head(), **self._text(message), **self._logprobs(entries),
                **self.final(completion, DONE_REASONS.get(reason or "", reason))}

    def writer(self, completion: Completion) -> StreamWriter:
        return OllamaStream(self, completion)

    def _head(self) -> dict:
        return {"model": self.parsed.sent_model if self.parsed else "", "created_at": created_at()}

    def _text(self, message: dict) -> dict:
        """The answer's text fields: chat's message, generate's response (and thinking beside it)."""
        thinking = message.get("reasoning_content") if self._shows_thinking else None
        if self.kind != "chat":
            return {"response": message.get("content") or "", **({"thinking": thinking} if thinking else {})}
        out = {"role": "assistant", "content": message.get("content") or ""}
        if thinking:
            out["thinking"] = thinking
        if message.get("tool_calls"):
            out["tool_calls"] = [ollama_call(call) for call in message["tool_calls"]]
        return {"message": out}

    @property
    def _shows_thinking(self) -> bool:
        return self.parsed is None or self.parsed.think is not False

    def _logprobs(self, entries) -> dict:
        if self.parsed is None or self.parsed.request.sampling.logprobs is None or not entries:
            return {}
        return {"logprobs": [{"token": e.token, "logprob": e.logprob,
                              "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in e.top]}
                             for e in entries]}

    def final(self, completion: Completion, reason: str | None) -> dict:
        """The last object's fields: done, done_reason and the counts and durations (durations)."""
        return {"done_reason": reason, "done": True,
                **durations(completion, self.inflight(completion.request_id), self.started)}


class OllamaChatApi(OllamaApi):
    route = "/api/chat"


class OllamaGenerateApi(OllamaApi):
    route = "/api/generate"
    kind = "generate"


def durations(completion: Completion, inflight, started: float, now: float | None = None) -> dict:
    """Ollama's counts and durations (nanoseconds). total: since the request came in; load: until it was queued
    (reading and checking the body, compiling a structured output, a model loading); prompt_eval: the prompt's
    prefill on a worker (its first token included); eval: the rest, until now. The wait in the prefill queue is
    in total alone. inflight: the request's edge.core.lifecycle.InFlight (None: only total is known)."""
    now = time.perf_counter() if now is None else now
    out = {"total_duration": _ns(now - started), "load_duration": 0,
           "prompt_eval_count": completion.num_prompt_tokens, "prompt_eval_duration": 0,
           "eval_count": completion.num_output_tokens, "eval_duration": 0}
    if inflight is None:
        return out
    # created was moved back by the wait for its model's load (counted in TTFT); Ollama's load_duration holds it
    out["load_duration"] = _ns(inflight.created + inflight.load_wait_s - started)
    first = inflight.handed_off_at or inflight.first_token_at
    if first is not None and inflight.prefill_started_at is not None:
        out["prompt_eval_duration"] = _ns(first - inflight.prefill_started_at)
    if first is not None:
        out["eval_duration"] = _ns(now - first)
    return out


def _ns(seconds: float) -> int:
    return max(0, round(seconds * NS))


def ollama_call(call: dict) -> dict:
    """An OpenAI-shaped tool call (edge.chat.output) as Ollama's: arguments an object, not JSON text."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"]) if isinstance(function["arguments"], str) else \
            function["arguments"]
    except json.JSONDecodeError:
        arguments = {}
    return {"id": call.get("id", ""), "function": {"name": function["name"],
                                                   "arguments": arguments if isinstance(arguments, dict) else {}}}


class OllamaStream(StreamWriter):
    """Ollama's NDJSON stream: a `done: false` object per piece of text (content, thinking, logprobs), the tool calls
    in one object once whole (Ollama sends whole calls, never fragments), then the `done: true` object."""

    def __init__(self, api: OllamaApi, completion: Completion) -> None:
        self.api, self.completion = api, completion
        self.calls: list[dict] = []  # OpenAI-shaped calls gathered from their fragments
        self.reason: str | None = None

    def event(self, delta: ChoiceDelta | None) -> bytes:
        if delta is None:
            return b""
        out = b""
        message = {"content": delta.content, "reasoning_content": delta.reasoning}
        entries = spoken(delta.logprobs, delta.content) if delta.finish_reason == "stop" else delta.logprobs
        logprobs = self.api._logprobs(entries)  # without the token that ended the answer (not in its text)
        if delta.content or (delta.reasoning and self.api._shows_thinking) or logprobs:
            out += ndjson({**self.api._head(), **self.api._text(message), **logprobs, "done": False})
        self._gather(delta.calls)
        if delta.finish_reason is not None:
            self.reason = DONE_REASONS.get(delta.finish_reason, delta.finish_reason)
            if self.calls:
                out += ndjson({**self.api._head(), **self.api._text({"content": "", "tool_calls": self.calls}),
                               "done": False})
        return out

    def _gather(self, fragments: tuple[dict, ...]) -> None:
        for fragment in fragments:
            function = fragment.get("function", {})
            if fragment.get("id") or not self.calls:
                self.calls.append({"id": fragment.get("id", ""), "function": {"name": function.get("name", ""),
                                                                              "arguments": ""}})
            self.calls[-1]["function"]["arguments"] += function.get("arguments", "")

    def close(self) -> bytes:
        reason = self.reason or self.completion.finish_reason
        api = self.api
        return ndjson({**api._head(), **api._text({"content": ""}), **api.final(self.completion, reason)})

    def error(self, err: ApiError) -> bytes:
        return error_line(err)
