"""OpenAI response bodies and stream chunks, built from the engine's token events."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from contracts.events import FinishReason, TokenEvent
from edge.openai_api import GenerateRequest
from edge.tools import may_be_a_call, parse_calls


@dataclass
class Choice:
    """One of a request's n answers, as far as it has come."""
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    num_output_tokens: int = 0
    finish_reason: str | None = None  # a FinishReason value
    sent_role: bool = False  # chat: its first chunk carried the role; completions: it carried the echo
    held: int = 0  # chat with tools: characters of text not streamed yet (it may be a tool call)


@dataclass
class Completion:
    """What a request has produced so far; shared by the streaming and non-streaming paths."""
    request_id: str
    request: GenerateRequest
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)  # request.sampling["n"] of them
    num_prompt_tokens: int = 0
    finish_reason: str | None = None  # the request's end: its last choice's FinishReason value
    error: object = None  # the ApiError that ended the request, if one did

    def __post_init__(self) -> None:
        self.choices = self.choices or [Choice(i) for i in range(self.request.sampling.get("n", 1))]

    def add(self, event: TokenEvent) -> None:
        choice = self.choices[event.index]
        choice.text.append(event.text)
        choice.logprobs.extend(event.logprobs)
        choice.num_output_tokens = event.num_output_tokens
        self.num_prompt_tokens = event.num_prompt_tokens or self.num_prompt_tokens
        if (ended := event.choice_finish or event.finish_reason) is not None:
            choice.finish_reason = ended.value
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason.value

    @property
    def usage(self) -> dict:
        completion = sum(choice.num_output_tokens for choice in self.choices)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion}

    def body(self) -> dict:
        obj = "chat.completion" if self.request.kind == "chat" else "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [self._choice_body(choice) for choice in self.choices], "usage": self.usage}

    def _choice_body(self, choice: Choice) -> dict:
        text = "".join(choice.text)
        reason = choice.finish_reason
        if self.request.kind == "chat":
            message = {"role": "assistant", "content": text}
            calls, rest = self._calls(choice, text)
            if calls:
                message, reason = {"role": "assistant", "content": rest or None, "tool_calls": calls}, "tool_calls"
            return {"index": choice.index, "message": message, "finish_reason": reason,
                    "logprobs": chat_logprobs(choice.logprobs) if self.request.chat_logprobs else None}
        text = self.request.prompt + text if self.request.echo else text
        return {"index": choice.index, "text": text, "finish_reason": reason,
                "logprobs": completion_logprobs(choice.logprobs) if self.request.sampling["logprobs"] is not None
                else None}

    def chunk(self, event: TokenEvent) -> dict | None:
        """The stream chunk for one engine event (added already); None when it carries nothing to send."""
        choice = self.choices[event.index]
        reason = _openai_finish(event.choice_finish or event.finish_reason)
        if not event.text and reason is None and choice.sent_role:
            return None
        if self.request.kind == "chat":
            delta, reason = (self._tool_delta(choice, reason) if self._tools_on
                             else ({"content": event.text}, reason))
            if delta is None:
                return None
            if not choice.sent_role:
                delta = {"role": "assistant", **delta}
            body = {"index": choice.index, "delta": delta, "finish_reason": reason,
                    "logprobs": chat_logprobs(event.logprobs) if self.request.chat_logprobs else None}
            obj = "chat.completion.chunk"
        else:
            text = self.request.prompt + event.text if self.request.echo and not choice.sent_role else event.text
            body = {"index": choice.index, "text": text, "finish_reason": reason,
                    "logprobs": completion_logprobs(event.logprobs)
                    if self.request.sampling["logprobs"] is not None else None}
            obj = "text_completion"
        choice.sent_role = True
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [body]}

    @property
    def _tools_on(self) -> bool:
        return self.request.tools is not None and self.request.tools.choice != "none"

    def _calls(self, choice: Choice, text: str) -> tuple[list[dict], str]:
        """The answer's tool calls and the text left: a forced call is parsed however it ended, a free one only
        from an answer that ended by itself (not cut by max_tokens or an error)."""
        if not self._tools_on or (choice.finish_reason not in ("stop", None) and not self.request.tools.constrained):
            return [], text
        return parse_calls(text, self.request.tools)

    def _tool_delta(self, choice: Choice, reason: str | None) -> tuple[dict | None, str | None]:
        """Text that may be a tool call is held back until it is clear; at the end, calls go out as one delta."""
        text = "".join(choice.text)
        if reason is None:
            if self.request.tools.constrained or may_be_a_call(text):
                return ({} if not choice.sent_role else None), None  # the role goes out at once, the text waits
            pending, choice.held = text[choice.held:], len(text)
            return ({"content": pending} if pending or not choice.sent_role else None), None
        calls, rest = self._calls(choice, text)  # add() has recorded this event's finish reason
        if calls:
            return {"content": rest[choice.held:] or None,
                    "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, "tool_calls"
        pending, choice.held = text[choice.held:], len(text)
        return {"content": pending}, reason

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.request.kind == "chat" else "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage}


def _openai_finish(reason: FinishReason | str | None) -> str | None:
    return reason.value if isinstance(reason, FinishReason) else reason


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
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries], "text_offset": offsets}


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
