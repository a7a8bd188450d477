"""One chat answer's text as the parts of an assistant message: reasoning (edge.chat.reasoning), content, and tool calls
(edge.chat.tool_parser), whole (`chat_message`) or as stream deltas (`ChatOutputStream`). Shared by the chat
completions route and the APIs built on the same path (Responses, Messages).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from edge.chat.reasoning import ReasoningStream, split_reasoning
from edge.chat.tool_formats import FORMATS, ChatFormat
from edge.chat.tool_parser import ToolCallStream, parse_tool_calls

if TYPE_CHECKING:
    from edge.chat.tools import ToolSpec


def _tools_on(tools: ToolSpec | None) -> bool:
    return tools is not None and tools.choice != "none"


def chat_message(text: str, chat: ChatFormat | None, tools: ToolSpec | None,
                 finish_reason: str | None) -> tuple[dict, str | None]:
    """(the assistant message, the finish reason) of a finished answer: "tool_calls" when it ended by itself after
    making calls. Free calls are taken only from an answer that ended by itself; forced ones (required, named)
    however it ended, but for a call cut short (its arguments incomplete JSON)."""
    reasoning, content = (split_reasoning(text, chat.think_in_prompt) if chat is not None and chat.reasoning
                          else (None, text))
    message: dict = {"role": "assistant", "content": content if content or reasoning is None else None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if _tools_on(tools) and (finish_reason in ("stop", None) or tools.constrained):
        rest, calls = parse_tool_calls(content, FORMATS[tools.format], tools.names, tools.parallel_calls)
        calls = [call for call in calls if _is_json(call["function"]["arguments"])]  # not one cut by max_tokens
        if calls:
            message.update(content=rest or None, tool_calls=calls)
            finish_reason = "tool_calls" if finish_reason in ("stop", None) else finish_reason
    return message, finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


class ChatOutputStream:
    """Feed a choice's text as it streams; each feed gives the delta fields that may go out now
    (reasoning_content, content, tool_calls), possibly none."""

    def __init__(self, chat: ChatFormat | None, tools: ToolSpec | None) -> None:
        self.reasoning = ReasoningStream(chat.think_in_prompt) if chat is not None and chat.reasoning else None
        self.tools = (ToolCallStream(FORMATS[tools.format], tools.names, tools.parallel_calls) if _tools_on(tools)
                      else None)

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    def feed(self, text: str, final: bool = False) -> dict:
        """final: the answer ended with this text (what was held back goes out too)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if final and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return self._delta(reasoning, content, final)

    def _delta(self, reasoning: str, content: str, final: bool) -> dict:
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls: list[dict] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta
