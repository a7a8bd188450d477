"""POST /v1/chat/completions: OpenAI's chat request, its chat.completion body and its chat.completion.chunk stream."""

from __future__ import annotations

from edge.api.client_api import ClientApi, StreamWriter
from edge.api.completion import Choice, ChoiceDelta, Completion
from edge.api.openai_bodies import chat_logprobs, degraded, error_chunk, spoken, sse, usage_chunk
from edge.api.openai_request import ApiError, GenerateRequest, parse_request

CHUNK = "chat.completion.chunk"


class ChatCompletionsApi(ClientApi):
    route = "/v1/chat/completions"

    def parse(self, body, vocab_size: int | None, chat=None, earlier: tuple[dict, ...] = ()) -> GenerateRequest:
        return parse_request(body, "chat", vocab_size=vocab_size, chat=chat)

    def body(self, completion: Completion) -> dict:
        body = {"id": completion.request_id, "object": "chat.completion", "created": completion.created,
                "model": completion.model, "choices": [_choice(completion, choice) for choice in completion.choices],
                "usage": completion.usage}
        return {**body, **degraded(completion)}

    def writer(self, completion: Completion) -> StreamWriter:
        return ChatStream(completion)


def _choice(completion: Completion, choice: Choice) -> dict:
    message, reason = completion.message(choice)
    logprobs = _logprobs(completion, choice, choice.logprobs)
    return {"index": choice.index, "message": message, "finish_reason": reason, "logprobs": logprobs}


def _logprobs(completion: Completion, choice: Choice, entries) -> dict | None:
    """Chat's logprobs objects; at a stop, without the token that ended the answer (not in its text)."""
    if not completion.request.chat_logprobs or completion.logprobs_stripped:
        return None
    return chat_logprobs(spoken(entries, "".join(choice.text)) if choice.finish_reason == "stop" else entries)


class ChatStream(StreamWriter):
    """OpenAI's chat stream: a choice opens with a chunk of the role alone and ends with a chunk that carries its
    finish_reason and no content; with include_usage a usage chunk follows the last; then [DONE]."""

    def __init__(self, completion: Completion) -> None:
        self.completion = completion

    def event(self, delta: ChoiceDelta | None) -> bytes:
        if delta is None:
            return b""
        out = b""
        if delta.first:
            out += self._chunk(delta.index, {"role": "assistant", "content": None}, None, None)
        fields = {name: value for name, value in (("reasoning_content", delta.reasoning), ("content", delta.content),
                                                  ("tool_calls", list(delta.calls))) if value}
        logprobs = _logprobs(self.completion, self.completion.choices[delta.index], delta.logprobs)
        if fields or (logprobs or {}).get("content"):
            out += self._chunk(delta.index, fields, None, logprobs)
        if delta.finish_reason is not None:
            out += self._chunk(delta.index, {}, delta.finish_reason, None)
        return out

    def _chunk(self, index: int, fields: dict, reason: str | None, logprobs: dict | None) -> bytes:
        completion = self.completion
        return sse({"id": completion.request_id, "object": CHUNK, "created": completion.created,
                    "model": completion.model, "choices": [{"index": index, "delta": fields, "finish_reason": reason,
                                                            "logprobs": logprobs}]})

    def close(self) -> bytes:
        usage = sse(usage_chunk(self.completion, CHUNK)) if self.completion.request.include_usage else b""
        return usage + sse("[DONE]")

    def error(self, err: ApiError) -> bytes:
        return sse(error_chunk(err)) + sse("[DONE]")
