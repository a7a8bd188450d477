"""POST /v1/responses as a translation: Responses bodies into the chat request, and the chat answer and chunks
into the response object and the semantic stream events (edge/api/responses.py)."""

import json

import pytest

from contracts.events import FinishReason, TokenEvent
from edge.api.completion import ChoiceDelta, Completion
from edge.api.openai_request import ApiError
from edge.api.responses import ResponsesApi

API = ResponsesApi()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}


def parse(**body):
    return API.parse({"model": "m", **body}, None)


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def token(text: str, n: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent("chatcmpl-abc", (n,), text, finish, num_prompt_tokens=7, num_output_tokens=n)


def run_stream(request, tokens) -> list[tuple[str, dict]]:
    completion = Completion("chatcmpl-abc", request, "m")
    writer = API.writer(completion)
    raw = b""
    for i, event in enumerate(tokens):
        completion.add(event)
        raw += (writer.open() if i == 0 else b"") + writer.event(completion.delta(event))
    return events(raw + writer.close())


def test_input_string_and_instructions_become_system_and_user_messages():
    request = parse(input="Hello", instructions="Be brief.", max_output_tokens=9, temperature=0.5, top_p=0.9)
    assert [(m["role"], m["content"]) for m in request.messages] == [("system", "Be brief."), ("user", "Hello")]
    assert request.sampling.max_tokens == 9 and request.sampling.temperature == 0.5
    assert request.sampling.top_p == 0.9 and request.sampling.n == 1 and not request.stream


def test_input_items_with_function_calls_and_outputs():
    request = parse(tools=[TOOL], input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It rains."}]}])
    roles = [m["role"] for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]  # the tool prompt leads
    assert "get_weather" in request.messages[0]["content"]
    calls = request.messages[2]["content"]  # both calls in one assistant turn, as Hermes text
    assert calls.count("<tool_call>") == 2 and '"Bergen"' in calls
    assert request.messages[3]["content"] == "rain" and request.tools.choice == "auto"


def test_tool_choice_and_text_format_are_translated():
    named = parse(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    assert named.tools.choice == "named" and named.tools.named == "get_weather"
    assert named.sampling.structured is not None  # the call is forced by a constraint
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped = parse(input="x", text={"format": {"type": "json_schema", "name": "out", "schema": schema}})
    assert shaped.sampling.structured == ("json_schema", json.dumps(schema))


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
])
def test_refusals_name_the_responses_field(body, param):
    with pytest.raises(ApiError) as refused:
        parse(**body)
    assert refused.value.status == 400 and refused.value.param == param
    assert "max_tokens" not in refused.value.message or param != "max_output_tokens"


def test_unknown_fields_are_ignored_as_on_chat():
    assert parse(input="x", metadata={"a": "b"}, service_tier="auto", store=False).messages[-1]["content"] == "x"


def test_body_of_a_text_answer():
    request = parse(input="x")
    completion = Completion("chatcmpl-abc", request, "m")
    for event in (token("Hel", 1), token("lo", 2, FinishReason.STOP)):
        completion.add(event)
    body = API.body(completion)
    assert body["id"] == "resp_abc" and body["object"] == "response" and body["status"] == "completed"
    assert body["output"] == [{"type": "message", "id": "msg_abc", "status": "completed", "role": "assistant",
                               "content": [{"type": "output_text", "text": "Hello", "annotations": [],
                                            "logprobs": []}]}]
    assert body["usage"]["input_tokens"] == 7 and body["usage"]["output_tokens"] == 2
    assert body["usage"]["total_tokens"] == 9 and body["store"] is True  # kept unless store: false


def test_stream_events_of_a_text_answer_in_order():
    request = parse(input="x", stream=True)
    got = run_stream(request, [token("Hel", 1), token("lo", 2), token("", 3, FinishReason.LENGTH)])
    assert [name for name, _ in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    assert all(data["type"] == name for name, data in got)
    assert got[0][1]["response"]["status"] == "in_progress" and got[0][1]["response"]["output"] == []
    assert [d["delta"] for n, d in got if n == "response.output_text.delta"] == ["Hel", "lo"]
    final = got[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 3


def test_stream_events_of_a_function_call():
    request = parse(input="x", tools=[TOOL], tool_choice="required", stream=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    got = run_stream(request, [token(call[:20], 1), token(call[20:50], 2), token(call[50:], 3, FinishReason.STOP)])
    names = [name for name, _ in got]
    deltas = [d["delta"] for n, d in got if n == "response.function_call_arguments.delta"]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert json.loads("".join(deltas)) == {"city": "Paris"}
    added, done = got[2][1]["item"], got[-2][1]["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress" and added["arguments"] == ""
    assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Paris"}
    assert done["call_id"].startswith("call_") and got[-1][1]["response"]["output"] == [done]


def test_reasoning_deltas_become_a_reasoning_item_before_the_message():
    completion = Completion("chatcmpl-abc", parse(input="x", stream=True), "m")
    completion.add(token("", 1, FinishReason.STOP))
    writer = API.writer(completion)

    raw = writer.open() + writer.event(ChoiceDelta(0, True, reasoning="think")) + \
        writer.event(ChoiceDelta(0, False, content="answer")) + \
        writer.event(ChoiceDelta(0, False, finish_reason="stop")) + writer.close()
    got = events(raw)
    names = [name for name, _ in got]
    assert names[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.done"]
    output = got[-1][1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == "think" and output[1]["content"][0]["text"] == "answer"


def test_an_error_mid_stream_is_an_error_event_then_response_failed():
    completion = Completion("chatcmpl-abc", parse(input="x", stream=True), "m")
    completion.add(token("Hi", 1))
    writer = API.writer(completion)
    writer.open()
    writer.event(completion.delta(token("Hi", 1)))
    completion.error = ApiError(503, "engine restarting", code="engine_unavailable", error_type="server_error")
    got = events(writer.error(completion.error))
    assert [name for name, _ in got] == ["error", "response.failed"]
    assert got[0][1]["code"] == "engine_unavailable"
    assert got[1][1]["response"]["status"] == "failed"
    assert got[1][1]["response"]["error"]["message"] == "engine restarting"


def test_errors_after_parsing_name_the_responses_field():
    response = API.error(ApiError(400, "the prompt has 9000 tokens, more than the context of 'max_tokens'",
                                  "messages", "context_length_exceeded"))
    assert response.status == 400 and json.loads(response.body)["error"]["param"] == "input"


def test_cached_prompt_tokens_in_usage():
    completion = Completion("chatcmpl-abc", parse(input="x"), "m")
    completion.add(token("", 1, FinishReason.STOP))
    completion.cached_tokens = 4
    usage = API.body(completion)["usage"]
    assert usage["input_tokens"] == 7 and usage["input_tokens_details"]["cached_tokens"] == 4
