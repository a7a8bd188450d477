"""Tool calls at the gateway: tools and tool_choice parsing, the Hermes prompt, the grammar of a forced call, and
finding calls in an answer (Hermes <tool_call> blocks and Llama 3.x JSON)."""

import json

import pytest

from edge.openai_api import ApiError, parse_request
from edge.tools import ToolSpec, parse_calls, parse_tools, with_tools

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
    assert request.tools.choice == "auto" and request.sampling["structured"] is None


def test_a_named_or_required_tool_choice_is_a_grammar_over_the_call():
    named = parse_request(_chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}), "chat")
    kind, schema = named.sampling["structured"]
    assert kind == "json_schema" and json.loads(schema)["properties"]["name"] == {"const": "get_weather"}
    required = parse_request(_chat(tools=[WEATHER, TIME], tool_choice="required"), "chat")
    assert len(json.loads(required.sampling["structured"][1])["anyOf"]) == 2
    assert parse_request(_chat(tools=[WEATHER], tool_choice="none"), "chat").messages[0]["role"] == "user"


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


def test_calls_are_found_in_hermes_blocks_and_llama_json():
    spec = parse_tools({"tools": [WEATHER, TIME]})
    calls, rest = parse_calls('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                              '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', spec)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"] and rest == "Let me check."
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"} and calls[0]["id"].startswith("call_")
    llama, _ = parse_calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}', spec)
    assert json.loads(llama[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_calls("It is sunny.", spec) == ([], "It is sunny.")
    assert parse_calls('{"name": "unknown", "arguments": {}}', spec)[0] == []
    single = ToolSpec(spec.tools, "auto", None, parallel=False)
    assert len(parse_calls('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2, single)[0]) == 1
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
