"""What a request has produced so far, in no API's shape: each choice's text, logprobs and ending, and per engine
event the ChoiceDelta a stream sends. Every client API (chat completions, completions, Responses, Messages) renders
these (edge.api.client_api), none another API's bodies or chunks."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from contracts.events import FinishReason, TokenEvent
from edge.api.openai_request import GenerateRequest
from edge.chat.output import ChatOutputStream, chat_message
from edge.chat.tool_formats import FORMATS
from edge.chat.tool_parser import new_call_id

NAME_SO_FAR = re.compile(r'"name"\s*:\s*"([^"]*)')  # a call's function name as far as it was written


@dataclass(frozen=True)
class ChoiceDelta:
    """What one engine event adds to a choice's stream (None from Completion.delta: nothing to send)."""
    index: int
    first: bool  # the choice's first delta (chat sends the role with it, a completion its echo)
    content: str = ""
    reasoning: str = ""  # a reasoning model's thinking (edge.chat.reasoning)
    calls: tuple[dict, ...] = ()  # tool-call fragments (edge.chat.tool_parser: id and name first, then arguments)
    finish_reason: str | None = None  # a FinishReason value, or "tool_calls": the answer ended by itself with calls
    logprobs: tuple = ()  # the event's contracts.events.Logprob entries


@dataclass
class Choice:
    """One of a request's n answers, as far as it has come."""
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    num_output_tokens: int = 0
    finish_reason: str | None = None  # a FinishReason value
    started: bool = False  # a delta of it went out (the role of a chat answer, the echo of a completion)
    output: ChatOutputStream | None = None  # chat with tools or reasoning: what splits its streamed text


@dataclass
class Completion:
    """What a request has produced so far; shared by the streaming and non-streaming paths of every API."""
    request_id: str
    request: GenerateRequest
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)  # request.sampling.n of them
    num_prompt_tokens: int = 0
    finish_reason: str | None = None  # the request's end: its last choice's FinishReason value
    error: object = None  # the ApiError that ended the request, if one did
    prompt_scores: object = None  # the worker's PromptLogprobs, when the request scored its prompt
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefill worker's prompt cache (its PrefillDone)

    def __post_init__(self) -> None:
        self.choices = self.choices or [Choice(i) for i in range(self.request.sampling.n)]

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
    def num_output_tokens(self) -> int:
        return sum(choice.num_output_tokens for choice in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        return min(self.cached_tokens, self.num_prompt_tokens)

    @property
    def usage(self) -> dict:
        """The request's usage as the gateway records it (Gateway.end), in OpenAI's shape."""
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_output_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    @property
    def logprobs_stripped(self) -> bool:
        """The client asked for logprobs and a degradation tier took them away ("strip"): said in the body too."""
        return self.request.asked_logprobs and self.request.sampling.logprobs is None

    def message(self, choice: Choice) -> tuple[dict, str | None]:
        """A finished chat choice as the assistant message (content, reasoning_content, tool_calls: edge.chat.output)
        and its finish reason ("tool_calls" when it ended by itself with calls)."""
        message, reason = chat_message("".join(choice.text), self.request.chat, self.request.tools,
                                       choice.finish_reason)
        return cut_call(message, reason, choice.finish_reason, self.request.tools)

    def delta(self, event: TokenEvent) -> ChoiceDelta | None:
        """What the engine event (added already) adds to its choice's stream; None when it carries nothing to send.
        Chat text with tools or thinking is split as it streams (text that may be a call or a tag is held back)."""
        choice = self.choices[event.index]
        ended = event.choice_finish or event.finish_reason
        reason = ended.value if isinstance(ended, FinishReason) else ended
        if not event.text and reason is None and choice.started:
            return None
        fields: dict | None = {"content": event.text}
        if self._splits:
            fields, reason = self._split(choice, event.text, reason)
            if fields is None:
                return None
        first, choice.started = not choice.started, True
        return ChoiceDelta(choice.index, first, fields.get("content", ""), fields.get("reasoning_content", ""),
                           tuple(fields.get("tool_calls", ())), reason, tuple(event.logprobs))

    @property
    def _splits(self) -> bool:
        """Chat text that is not all content: tool calls, or a reasoning model's thinking (edge.chat.output)."""
        tools, chat = self.request.tools, self.request.chat
        return (tools is not None and tools.choice != "none") or (chat is not None and bool(chat.reasoning))

    def _split(self, choice: Choice, text: str, reason: str | None) -> tuple[dict | None, str | None]:
        """What of the text may go out now; at the end, the rest, and finish_reason "tool_calls" when calls went
        out. None: nothing to send (a choice's first delta always goes out, if empty)."""
        if choice.output is None:
            choice.output = ChatOutputStream(self.request.chat, self.request.tools)
        fields = choice.output.feed(text, final=reason is not None)
        if reason is None:
            return (fields or ({} if not choice.started else None)), None
        tools = self.request.tools
        if reason == "length" and tools is not None and tools.constrained and not choice.output.made_calls:
            return _cut_fragment(fields, tools), reason
        return fields, "tool_calls" if choice.output.made_calls and reason == "stop" else reason


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
    if len(called) == 1:
        name = called[0]
    else:  # cut before the function's name was whole: as much of it as was written, never the markup as content
        written = NAME_SO_FAR.search(text)
        name = written.group(1) if written else ""
    start = text.find("{", max(text.find('"arguments"'), text.find('"parameters"')))
    arguments = text[start:] if start >= 0 and ('"arguments"' in text or '"parameters"' in text) else ""
    call = {"id": new_call_id(FORMATS[tools.format]), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    return {**message, "content": None, "tool_calls": [call]}, "length"


def _cut_fragment(fields: dict, tools) -> dict:
    """A forced call cut by max_tokens before any call went out in the stream: the held-back text (the call's
    markup so far) as one call fragment (cut_call's), not as content."""
    message, _ = cut_call({"role": "assistant", "content": fields.get("content") or ""}, "length", "length", tools)
    call = message["tool_calls"][0]
    rest = {key: value for key, value in fields.items() if key != "content"}
    return {**rest, "tool_calls": [{"index": 0, **call}]}
