"""Reasoning content (edge.chat.reasoning, edge.chat.output): a thinking model's <think> text goes to reasoning_content,
whole and streamed; chat completions' bodies and stream chunks carry it; max_reasoning_tokens is refused."""

import json

import pytest

from contracts.events import FinishReason, TokenEvent
from edge.api.chat_completions import ChatCompletionsApi
from edge.api.completion import Completion
from edge.api.openai_request import ApiError, parse_request
from edge.chat.output import chat_message
from edge.chat.reasoning import ReasoningStream, detect_reasoning, opens_thinking, split_reasoning
from edge.chat.tool_formats import ChatFormat

QWEN3 = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is "
         "defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
R1 = ("{% for message in messages %}{% if message['role'] == 'user' %}{{'<｜User｜>' + message['content']}}{% endif %}"
      "{% endfor %}{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
PLAIN = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def test_thinking_models_are_detected_from_their_templates():
    assert detect_reasoning(QWEN3) == detect_reasoning(R1) == "think" and detect_reasoning(PLAIN) == ""
    assert opens_thinking(R1) and not opens_thinking(QWEN3)


@pytest.mark.parametrize("text, in_prompt, reasoning, content", [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.\n", "Paris."),
    ("Paris.", False, None, "Paris."),  # Qwen3 may skip the thinking
    ("  <think>a < b</think>yes", False, "a < b", "yes"),
    ("Let me see.\n</think>\n\nParis.", True, "Let me see.\n", "Paris."),  # R1: the prompt opened it
    ("Let me see, still thinking", True, "Let me see, still thinking", ""),  # cut inside the thinking
    ("<think>cut short", False, "cut short", ""),
])
def test_the_thinking_is_split_from_the_answer_whole_and_streamed(text, in_prompt, reasoning, content):
    assert split_reasoning(text, in_prompt) == (reasoning, content)
    for step in (1, 2, 5):
        stream, got_reasoning, got_content = ReasoningStream(in_prompt), "", ""
        for at in range(0, len(text), step):
            r, c = stream.feed(text[at:at + step])
            got_reasoning, got_content = got_reasoning + r, got_content + c
        r, c = stream.finish()
        assert (got_reasoning + r, got_content + c) == (reasoning or "", content)


def test_a_streamed_close_tag_in_pieces_is_held_back_not_leaked():
    stream = ReasoningStream(False)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>abc</th") == ("abc", "")
    assert stream.feed("ink>\n\nAnswer") == ("", "Answer")


def _completion(chat: ChatFormat, body: dict | None = None, **fields) -> Completion:
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **(body or {}), **fields},
                            "chat", chat=chat)
    return Completion("chatcmpl-1", request, "m")


def _events(pieces: list[str]) -> list[TokenEvent]:
    return [TokenEvent("chatcmpl-1", (i,), piece, FinishReason.STOP if i == len(pieces) - 1 else None,
                       num_output_tokens=i + 1) for i, piece in enumerate(pieces)]


PIECES = ["<think>", "\nHmm", ", Paris", ".\n</", "think>\n\n", "Paris", "."]


def test_chat_bodies_and_stream_chunks_carry_reasoning_content():
    chat = ChatFormat(reasoning="think")
    whole = _completion(chat)
    for event in _events(PIECES):
        whole.add(event)
    message = ChatCompletionsApi().body(whole)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": "Hmm, Paris.\n"}
    stream, reasoning, content = _completion(chat, stream=True), "", ""
    for event in _events(PIECES):
        stream.add(event)
        delta = stream.delta(event)
        if delta is not None:
            reasoning += delta.reasoning
            content += delta.content
    assert (reasoning, content) == (message["reasoning_content"], "Paris.")
    assert delta.finish_reason == "stop"
    plain = _completion(ChatFormat())
    for event in _events(PIECES):
        plain.add(event)
    assert ChatCompletionsApi().body(plain)["choices"][0]["message"] == {"role": "assistant", "content": "".join(PIECES)}


def test_a_constraint_applies_after_the_thinking_and_tool_calls_are_parsed_from_the_answer():
    chat = ChatFormat(reasoning="think")
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "response_format": {"type": "json_object"}}, "chat", chat=chat)
    kind, lark = request.sampling.structured
    assert kind == "grammar" and "think_start" in lark and "%json" in lark
    tools = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{
        "type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "chat", chat=chat).tools
    message, reason = chat_message('<think>call f</think>\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
                                   '</tool_call>', chat, tools, "stop")
    assert reason == "tool_calls" and message["reasoning_content"] == "call f" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


def test_max_reasoning_tokens_is_refused_naming_the_field():
    with pytest.raises(ApiError) as info:
        parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_reasoning_tokens": 64},
                      "chat", chat=ChatFormat(reasoning="think"))
    assert (info.value.status, info.value.param) == (400, "max_reasoning_tokens")
    assert "</think>" in info.value.message
