"""The pieces OpenAI's chat completions and completions answers share: logprobs in their two shapes, the note of a
feature a degradation tier took away, the usage chunk, the error chunk and the server-sent event."""

from __future__ import annotations

import json

from edge.api.completion import Completion
from edge.api.openai_request import ApiError


def degraded(completion: Completion) -> dict:
    if not completion.logprobs_stripped:
        return {}
    return {"degraded": {"logprobs": "not computed: the server is under load and its policy drops logprobs "
                                     "(see the X-Edge-Tier and X-Edge-Degraded headers); retry later"}}


def usage_chunk(completion: Completion, obj: str) -> dict:
    """The last chunk of a stream with stream_options.include_usage."""
    return {"id": completion.request_id, "object": obj, "created": completion.created, "model": completion.model,
            "choices": [], "usage": completion.usage, **degraded(completion)}


def summed_usage(usages: list[dict]) -> dict:
    """The usage of several requests answered as one (a completions batch): every count summed."""
    usage = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
    return {**usage, "prompt_tokens_details": {"cached_tokens": cached}}


def error_chunk(err: ApiError) -> dict:
    """An error after the stream's headers went out: it travels in the stream, then the stream ends."""
    return {"error": {"message": err.message, "type": err.error_type, "param": None, "code": err.code}}


def spoken(entries, text: str) -> tuple:
    """A choice's logprob entries without the token that ended it (the end-of-turn token, or the last token of a
    stop string), whose text is not in the answer: the entries then join back into the content."""
    entries = tuple(entries)
    if entries and entries[-1].token and not text.endswith(entries[-1].token):
        return entries[:-1]
    return entries


def chat_logprobs(entries) -> dict:
    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}
    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t.token, t.logprob) for t in e.top]}
                        for e in entries]}


def completion_logprobs(entries) -> dict:
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_top(e) for e in entries], "text_offset": offsets}


def _top(entry) -> dict:
    """The alternatives, and the sampled token always (as vLLM: with logprobs 0, the sampled token alone)."""
    top = {t.token: t.logprob for t in entry.top}
    top.setdefault(entry.token, entry.logprob)
    return top


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
