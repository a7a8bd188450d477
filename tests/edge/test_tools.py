"""Tool calls at the gateway: tools and tool_choice parsing, the Hermes prompt for templates without tool support,
the tools and earlier calls handed to a template that renders them, and the grammar of each tool_choice (the
grammars' behaviour: test_tool_formats.py; the parsers: test_tool_parsers.py)."""

import json

import pytest

from edge.api.openai_request import ApiError, parse_request
from edge.chat.tool_formats import ChatFormat
from edge.chat.tools import with_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}


def test_tools_go_into_the_system_prompt_and_history_calls_become_hermes_text():
    request = parse_request(_chat(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]), "chat")
    system, _, assistant, tool = request.messages
    assert system["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in system["content"]
    assert assistant["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tool == {"role": "tool", "content": "sunny"}
    assert request.tools.choice == "auto" and request.sampling.structured[0] == "grammar"


def test_each_tool_choice_but_none_is_a_grammar_in_the_model_s_format():
    named = parse_request(_chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}), "chat")
    kind, lark = named.sampling.structured
    assert kind == "grammar" and named.structured_param == "tools"
    assert '"get_weather"' in lark and '"get_time"' not in lark and '"<tool_call>\\n"' in lark
    required = parse_request(_chat(tools=[WEATHER, TIME], tool_choice="required"), "chat")
    assert '"get_weather"' in required.sampling.structured[1] and '"get_time"' in required.sampling.structured[1]
    auto = parse_request(_chat(tools=[WEATHER]), "chat")
    assert auto.sampling.structured[0] == "grammar" and "NOCALL" in auto.sampling.structured[1]
    none = parse_request(_chat(tools=[WEATHER], tool_choice="none"), "chat")
    assert none.messages[0]["role"] == "user" and none.sampling.structured is None
    llama = parse_request(_chat(tools=[WEATHER], tool_choice="required"), "chat", chat=ChatFormat("llama3_json", True))
    assert '"parameters"' in llama.sampling.structured[1] and llama.tools.format == "llama3_json"


def test_a_template_that_renders_tools_gets_them_and_the_earlier_calls_as_they_came():
    chat = ChatFormat("hermes", template_tools=True)
    request = parse_request(_chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]), "chat", chat=chat)
    user, assistant, tool = request.messages
    assert user == {"role": "user", "content": "Weather in Paris?"}  # no Hermes preamble: the template writes the tools
    assert json.loads(assistant["tool_calls_json"]) == [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert json.loads(request.template_tools) == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER["function"]["parameters"]}}]
    assert parse_request(_chat(tools=[WEATHER]), "chat").template_tools == ""  # the fallback writes them itself
    assert parse_request(_chat(tools=[WEATHER], tool_choice="none"), "chat", chat=chat).template_tools == ""


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": "x"}, "tools"),
])
def test_bad_tools_are_a_400_naming_the_field(fields, param):
    with pytest.raises(ApiError) as info:
        parse_request(_chat(**fields), "chat")
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_messages_without_tools_are_passed_as_they_are():
    assert with_tools([{"role": "user", "content": "hi", "tool_calls": ()}], None) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("messages, tools, param", [
    ([], [{"type": "function", "function": {"name": "f", "description": "x\ud800"}}], "tools[0].function"),
    ([], [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "\udfff"}}}],
     "tools[0].function"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "id": "c", "function": {"name": "f", "arguments": '{"x": "\ud800"}'}}]}], None,
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "id": "c", "function": {"name": "f", "arguments": '{"a":' * 5000 + "1" + "}" * 5000}}]}],
     None, "messages[1].tool_calls[0].function.arguments"),
])
def test_tool_text_that_cannot_travel_is_a_400_not_a_500(messages, tools, param):
    body = _chat(messages=[{"role": "user", "content": "hi"}, *messages], **({"tools": tools} if tools else {}))
    with pytest.raises(ApiError) as info:
        parse_request(body, "chat")
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_chat_bodies_and_stream_chunks_carry_the_calls():
    from contracts.events import FinishReason, TokenEvent
    from edge.api.chat_completions import ChatCompletionsApi
    from edge.api.completion import Completion
    pieces = ["Let me check.", "\n<tool_", 'call>\n{"name": "get_weather", "argu', 'ments": {"city": ', '"Rome"}}',
              "\n</tool_call>"]
    events = [TokenEvent("c", (i,), p, FinishReason.STOP if i == len(pieces) - 1 else None, num_output_tokens=i + 1)
              for i, p in enumerate(pieces)]
    whole = Completion("c", parse_request(_chat(tools=[WEATHER]), "chat"), "m")
    for event in events:
        whole.add(event)
    (choice,) = ChatCompletionsApi().body(whole)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    streamed = Completion("c", parse_request(_chat(tools=[WEATHER], stream=True), "chat"), "m")
    deltas = []
    for event in events:
        streamed.add(event)
        if (delta := streamed.delta(event)) is not None:
            deltas.append(delta)
    assert deltas[0].first and deltas[0].content == "Let me check." and deltas[-1].finish_reason == "tool_calls"
    calls = [c for d in deltas for c in d.calls]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}' and len(calls) > 2
    assert all(not d.content for d in deltas[1:])


def test_a_forced_call_cut_by_max_tokens_is_dropped_and_the_reason_stays_length():
    from edge.chat.output import chat_message
    spec = parse_request(_chat(tools=[WEATHER, TIME], tool_choice="required"), "chat").tools
    two = ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
           '"arguments": {"city": "Ro')
    message, reason = chat_message(two, None, spec, "length")
    assert reason == "length" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    message, reason = chat_message(two.split("\n</tool_call>")[0], None, spec, "stop")
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["arguments"] == "{}"


def test_a_format_set_for_a_template_without_tools_is_the_one_the_preamble_asks_for():
    request = parse_request(_chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]), "chat", chat=ChatFormat("llama3_json"))
    system, _, assistant, _ = request.messages
    assert system["content"].endswith('answer with this and nothing else:\n{"name": <function-name>, "parameters": '
                                      '<args-json-object>}')
    assert assistant["content"] == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
