"""OpenAI response bodies and stream chunks, built from the engine's token events."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from contracts.events import FinishReason, TokenEvent
from edge.api.openai_request import GenerateRequest
from edge.api.prompt_scores import echo_text, vllm_prompt_logprobs, with_prompt
from edge.chat.output import ChatOutputStream, chat_message
from edge.chat.tool_formats import FORMATS
from edge.chat.tool_parser import new_call_id


@dataclass
class Choice:
    """One of a request's n answers, as far as it has come."""
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    num_output_tokens: int = 0
    finish_reason: str | None = None  # a FinishReason value
    sent_role: bool = False  # chat: its first chunk carried the role; completions: it carried the echo
    output: ChatOutputStream | None = None  # chat with tools or reasoning: what splits its streamed text


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
    prompt_scores: object = None  # the worker's PromptLogprobs, when the request scored its prompt
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefill worker's prompt cache (its PrefillDone)

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
                "total_tokens": self.num_prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": min(self.cached_tokens, self.num_prompt_tokens)}}

    @property
    def logprobs_stripped(self) -> bool:
        """The client asked for logprobs and a degradation tier took them away ("strip"): said in the body too."""
        return self.request.asked_logprobs and self.request.sampling["logprobs"] is None

    def body(self) -> dict:
        obj = "chat.completion" if self.request.kind == "chat" else "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [self._choice_body(choice) for choice in self.choices], "usage": self.usage}
        return {**body, **self._degraded()}

    def _degraded(self) -> dict:
        if not self.logprobs_stripped:
            return {}
        return {"degraded": {"logprobs": "not computed: the server is under load and its policy drops logprobs "
                                         "(see the X-Edge-Tier and X-Edge-Degraded headers); retry later"}}

    def _choice_body(self, choice: Choice) -> dict:
        text = "".join(choice.text)
        reason = choice.finish_reason
        if self.request.kind == "chat":
            message, reason = chat_message(text, self.request.chat, self.request.tools, reason)
            message, reason = cut_call(message, reason, choice.finish_reason, self.request.tools)
            logprobs = self._chat_logprobs(choice.logprobs, text, choice.finish_reason)
            return {"index": choice.index, "message": message, "finish_reason": reason, "logprobs": logprobs}
        text = echo_text(self.request.prompt, self.prompt_scores) + text if self.request.echo else text
        body = {"index": choice.index, "text": text, "finish_reason": reason,
                "logprobs": self._completion_logprobs(choice.logprobs, echoed=self.request.echo)}
        return self._with_prompt_logprobs(body)

    def _completion_logprobs(self, entries, echoed: bool) -> dict | None:
        top_k = self.request.sampling["logprobs"]
        if top_k is None:
            return None
        generated = completion_logprobs(entries)
        return with_prompt(self.prompt_scores, top_k, generated) if echoed and self.prompt_scores else generated

    def _with_prompt_logprobs(self, body: dict) -> dict:
        if self.request.prompt_logprobs is not None and self.prompt_scores is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.prompt_scores, self.request.prompt_logprobs)
        return body

    def _chat_logprobs(self, entries, text: str, finish_reason: str | None) -> dict | None:
        if not self.request.chat_logprobs or self.logprobs_stripped:
            return None
        return chat_logprobs(spoken(entries, text) if finish_reason == "stop" else entries)

    def chunks(self, event: TokenEvent) -> list[dict]:
        """The OpenAI stream chunks for one engine event (added already), as OpenAI sends them: a chat stream opens
        with a chunk of the role alone and ends with a chunk that carries finish_reason and no content."""
        chunk = self.chunk(event)
        if chunk is None or self.request.kind != "chat":
            return [chunk] if chunk is not None else []
        body = chunk["choices"][0]
        delta, reason = {k: v for k, v in body["delta"].items() if v != ""}, body["finish_reason"]
        out = []
        if "role" in delta:
            del delta["role"]
            out.append(self._chat_chunk(body["index"], {"role": "assistant", "content": None}, None, None))
        if delta or (body["logprobs"] or {}).get("content"):
            out.append(self._chat_chunk(body["index"], delta, None, body["logprobs"]))
        if reason is not None:
            out.append(self._chat_chunk(body["index"], {}, reason, None))
        return out

    def _chat_chunk(self, index: int, delta: dict, reason: str | None, logprobs: dict | None) -> dict:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [{"index": index, "delta": delta, "finish_reason": reason,
                                                  "logprobs": logprobs}]}

    def chunk(self, event: TokenEvent) -> dict | None:
        """The stream chunk for one engine event (added already); None when it carries nothing to send."""
        choice = self.choices[event.index]
        reason = _openai_finish(event.choice_finish or event.finish_reason)
        if not event.text and reason is None and choice.sent_role:
            return None
        if self.request.kind == "chat":
            delta, reason = (self._split_delta(choice, event.text, reason) if self._splits
                             else ({"content": event.text}, reason))
            if delta is None:
                return None
            if not choice.sent_role:
                delta = {"role": "assistant", **delta}
            body = {"index": choice.index, "delta": delta, "finish_reason": reason,
                    "logprobs": self._chat_logprobs(event.logprobs, "".join(choice.text), choice.finish_reason)}
            obj = "chat.completion.chunk"
        else:
            echoing = self.request.echo and not choice.sent_role
            text = echo_text(self.request.prompt, self.prompt_scores) + event.text if echoing else event.text
            body = {"index": choice.index, "text": text, "finish_reason": reason,
                    "logprobs": self._completion_logprobs(event.logprobs, echoed=echoing)}
            if not choice.sent_role:
                body = self._with_prompt_logprobs(body)
            obj = "text_completion"
        choice.sent_role = True
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [body]}

    @property
    def _splits(self) -> bool:
        """Chat text that is not all content: tool calls, or a reasoning model's thinking (edge.chat.output)."""
        tools, chat = self.request.tools, self.request.chat
        return (tools is not None and tools.choice != "none") or (chat is not None and bool(chat.reasoning))

    def _split_delta(self, choice: Choice, text: str, reason: str | None) -> tuple[dict | None, str | None]:
        """What of the text may go out now (text that may be a call or a tag is held back); at the end, the rest,
        and finish_reason "tool_calls" when calls went out."""
        if choice.output is None:
            choice.output = ChatOutputStream(self.request.chat, self.request.tools)
        delta = choice.output.feed(text, final=reason is not None)
        if reason is None:
            return (delta or ({} if not choice.sent_role else None)), None
        return delta, "tool_calls" if choice.output.made_calls and reason == "stop" else reason

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.request.kind == "chat" else "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage, **self._degraded()}


def _openai_finish(reason: FinishReason | str | None) -> str | None:
    return reason.value if isinstance(reason, FinishReason) else reason


def spoken(entries, text: str) -> tuple:
    """A choice's logprob entries without the token that ended it (the end-of-turn token, or the last token of a
    stop string), whose text is not in the answer: the entries then join back into the content."""
    entries = tuple(entries)
    if entries and entries[-1].token and not text.endswith(entries[-1].token):
        return entries[:-1]
    return entries


def cut_call(message: dict, reason: str | None, ended: str | None, tools) -> tuple[dict, str | None]:
    """A forced tool call (tool_choice required or named) cut by max_tokens is still a call, as OpenAI answers: a
    tool_calls entry with the arguments written so far, and finish_reason "length"."""
    if ended != "length" or tools is None or not tools.constrained:
        return message, reason
    if message.get("tool_calls"):
        return message, "length"
    names = [tools.named] if tools.choice == "named" else sorted(tools.names)
    text = message.get("content") or ""
    called = [name for name in names if f'"{name}"' in text] or (names if len(names) == 1 else [])
    if len(called) != 1:  # cut before the function's name was written: which one is not known
        return message, reason
    start = text.find("{", max(text.find('"arguments"'), text.find('"parameters"')))
    arguments = text[start:] if start >= 0 and ('"arguments"' in text or '"parameters"' in text) else ""
    call = {"id": new_call_id(FORMATS[tools.format]), "type": "function",
            "function": {"name": called[0], "arguments": arguments}}
    return {**message, "content": None, "tool_calls": [call]}, "length"


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
