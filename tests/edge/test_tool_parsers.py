"""Tool calls out of answers, per family format (edge.chat.tool_parser): whole answers and the same answers streamed in
small pieces give the same calls; streamed calls go out as OpenAI tool_calls deltas (index, id, type, name, then
argument fragments that join into the arguments)."""

import json

import pytest

from edge.chat.tool_formats import FORMATS
from edge.chat.tool_parser import ToolCallStream, parse_tool_calls

NAMES = {"get_weather", "get_time"}
ROME = {"city": "Rome"}

# family -> (answer with one call after some text, or at the start where the family's calls are the whole answer;
#            answer with two calls)
ANSWERS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Rome"}}',
                    '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
                '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]'),
    "phi4_mini": ('Let me check. functools[{"name": "get_weather", "arguments": {"city": "Rome"}}]',
                  'functools[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                  '{"name": "get_time", "arguments": {}}]'),
}


def streamed(text: str, family: str, parallel: bool = True, step: int = 3) -> tuple[str, list[dict]]:
    """(the content, the calls) joined from the stream's pieces, fed `step` characters at a time."""
    stream = ToolCallStream(FORMATS[family], NAMES, parallel)
    content, deltas = "", []
    for at in range(0, len(text), step):
        piece, out = stream.feed(text[at:at + step])
        content, deltas = content + piece, deltas + out
    piece, out = stream.finish()
    return content + piece, deltas + out


def joined(deltas: list[dict]) -> list[dict]:
    """The calls the deltas make, as a client library joins them."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
        assert set(delta) <= {"index", "id", "type", "function"}
        if "id" in delta:
            assert "id" not in call and delta["type"] == "function", "one header per call"
            call.update(id=delta["id"], type="function")
        call["function"]["name"] += delta["function"].get("name", "")
        call["function"]["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("family", sorted(ANSWERS))
def test_each_family_s_calls_are_found_whole_and_streamed(family):
    one, two = ANSWERS[family]
    content, calls = parse_tool_calls(one, FORMATS[family], NAMES)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_weather", ROME)]
    assert content == ("Let me check." if one.startswith("Let") else "")
    assert calls[0]["type"] == "function" and calls[0]["id"]
    stream_content, deltas = streamed(one, family)
    assert stream_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in joined(deltas)] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert len(deltas) > 2, "the arguments come in fragments as they are written"
    _, parallel = parse_tool_calls(two, FORMATS[family], NAMES)
    assert [c["function"]["name"] for c in parallel] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in parallel] == [ROME, {}]
    assert [c["function"]["name"] for c in joined(streamed(two, family)[1])] == ["get_weather", "get_time"]
    assert len({c["id"] for c in parallel}) == 2


@pytest.mark.parametrize("family", sorted(ANSWERS))
def test_without_parallel_calls_only_the_first_is_kept(family):
    _, calls = parse_tool_calls(ANSWERS[family][1], FORMATS[family], NAMES, parallel=False)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert [c["function"]["name"] for c in joined(streamed(ANSWERS[family][1], family, parallel=False)[1])] == \
        ["get_weather"]


@pytest.mark.parametrize("family, text", [
    ("hermes", "It is sunny in Rome."),
    ("hermes", "I would write <tool_call> here, but no."),  # an opener followed by no call
    ("llama3_json", '{"city": "Rome", "temp": 21}'),  # JSON, not a call
    ("llama3_json", '{"name": "unknown_tool", "parameters": {}}'),  # a name that is no tool
    ("mistral", "[Rome](https://example.org) is sunny."),  # a Markdown link, not a list of calls
    ("phi4_mini", "No tools needed."),
])
def test_text_that_is_no_call_is_content_whole_and_streamed(family, text):
    assert parse_tool_calls(text, FORMATS[family], NAMES) == (text, [])
    for step in (1, 4, 100):
        assert streamed(text, family, step=step) == (text, [])


def test_streamed_content_is_held_back_only_while_it_may_start_a_call():
    stream = ToolCallStream(FORMATS["hermes"], NAMES)
    assert stream.feed("Let me check. <tool_") == ("Let me check.", [])  # the partial tag and the space wait
    content, deltas = stream.feed('call>\n{"name": "get_weather", "arguments": {"ci')
    assert content == "" and deltas[0] == {"index": 0, "id": deltas[0]["id"], "type": "function",
                                           "function": {"name": "get_weather", "arguments": ""}}
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"ci'}}
    assert stream.feed('ty": "Rome"}}\n</tool_call>') == ("", [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}])
    assert stream.finish() == ("", [])
    llama = ToolCallStream(FORMATS["llama3_json"], NAMES)
    assert llama.feed("  ") == ("", [])  # white space at the start may precede the call's JSON
    assert llama.feed("Sunny") == ("  Sunny", [])


def test_a_call_without_arguments_gets_an_empty_object_and_an_answer_cut_short_keeps_what_came():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "get_time"}\n</tool_call>', FORMATS["hermes"], NAMES)
    assert calls[0]["function"]["arguments"] == "{}"
    content, deltas = streamed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro', "hermes")
    assert content == "" and joined(deltas)[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Ro'}


def test_mistral_call_ids_are_nine_letters_and_digits():
    _, calls = parse_tool_calls(ANSWERS["mistral"][0], FORMATS["mistral"], NAMES)
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()
    _, calls = parse_tool_calls(ANSWERS["hermes"][0], FORMATS["hermes"], NAMES)
    assert calls[0]["id"].startswith("call_")
