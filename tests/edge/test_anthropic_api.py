"""POST /v1/messages as a translation: Anthropic bodies into the chat request, the chat answer and chunks into a
message and Anthropic's stream events, errors into Anthropic's shape (edge/api/messages.py)."""

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_gateway import fake_gateway, keyed

from contracts.events import FinishReason, TokenEvent
from edge.api.completion import ChoiceDelta, Completion
from edge.api.messages import MessagesApi, error_response, worker_messages
from edge.api.openai_request import ApiError
from edge.http.routes import add_routes
from edge.state import GATEWAY

API = MessagesApi()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "weather", "input_schema": WEATHER}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def parse(**body):
    return API.parse({"model": "m", "max_tokens": 16, **body}, None)


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def token(text: str, n: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent("chatcmpl-abc", (n,), text, finish, num_prompt_tokens=11, num_output_tokens=n)


def run_stream(request, tokens) -> list[tuple[str, dict]]:
    completion = Completion("chatcmpl-abc", request, "m")
    writer = API.writer(completion)
    raw = b""
    for i, event in enumerate(tokens):
        completion.add(event)
        raw += (writer.open() if i == 0 else b"") + writer.event(completion.delta(event))
    return events(raw + writer.close())


def test_system_blocks_sampling_and_stop_sequences():
    request = parse(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                    messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                    temperature=0.2, top_p=0.8, top_k=5, stop_sequences=["END"], stream=True)
    assert [(m["role"], m["content"]) for m in request.messages] == [("system", "Be brief."), ("user", "Hi")]
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (16, 0.2, 0.8, 5)
    assert sampling.stop == ("END",) and request.stream


def test_tool_use_and_tool_result_history():
    request = parse(tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    roles = [m["role"] for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert "Let me look." in request.messages[2]["content"] and "Oslo" in request.messages[2]["content"]
    assert "hm" not in request.messages[2]["content"]  # earlier thinking is left out
    assert request.messages[3]["content"] == "rain" and request.messages[4]["content"] == "And tomorrow?"
    assert [m["role"] for m in worker_messages(request)] == roles


@pytest.mark.parametrize(("choice", "expect"), [
    ({"type": "auto"}, ("auto", None, True)), ({"type": "any"}, ("required", None, True)),
    ({"type": "tool", "name": "get_weather"}, ("named", "get_weather", True)),
    ({"type": "any", "disable_parallel_tool_use": True}, ("required", None, False))])
def test_tool_choice(choice, expect):
    tools = parse(tools=[TOOL], tool_choice=choice, messages=[{"role": "user", "content": "x"}]).tools
    assert (tools.choice, tools.named, tools.parallel) == expect


def test_tool_choice_none_sends_no_tools():
    request = parse(tools=[TOOL], tool_choice={"type": "none"}, messages=[{"role": "user", "content": "x"}])
    assert request.tools.choice == "none" and "get_weather" not in request.messages[0]["content"]


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0]"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"system": [{"type": "image"}]}, "system"),
])
def test_refusals_name_the_anthropic_field(body, param):
    full = {"messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(ApiError) as refused:
        parse(**full)
    assert refused.value.status == 400 and refused.value.param == param


def test_errors_answer_in_anthropic_shape():
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
                         (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"),
                         (500, "api_error"), (503, "overloaded_error"), (504, "timeout_error")):
        response = error_response(ApiError(status, "why", headers={"Retry-After": "2"}))
        assert response.status == status and response.headers["Retry-After"] == "2"
        assert json.loads(response.body) == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_body_of_a_text_answer_and_of_a_tool_use():
    request = parse(messages=[{"role": "user", "content": "x"}])
    completion = Completion("chatcmpl-abc", request, "m")
    completion.add(token("Hello", 1))
    completion.add(token("", 2, FinishReason.LENGTH))
    body = API.body(completion)
    assert body == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                    "content": [{"type": "text", "text": "Hello"}], "stop_reason": "max_tokens",
                    "stop_sequence": None, "usage": {"input_tokens": 11, "output_tokens": 2,
                                                     "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
    tooled = parse(tools=[TOOL], tool_choice={"type": "any"}, messages=[{"role": "user", "content": "x"}])
    completion = Completion("chatcmpl-abc", tooled, "m")
    completion.add(token(CALL, 1, FinishReason.STOP))
    body = API.body(completion)
    assert body["stop_reason"] == "tool_use" and body["content"][0]["type"] == "tool_use"
    assert body["content"][0]["input"] == {"city": "Oslo"} and body["content"][0]["id"].startswith("toolu_")


def test_stream_of_text_in_anthropic_order():
    got = run_stream(parse(messages=[{"role": "user", "content": "x"}], stream=True),
                     [token("Hel", 1), token("lo", 2), token("", 3, FinishReason.STOP)])
    assert [name for name, _ in got] == ["message_start", "content_block_start", "content_block_delta",
                                         "content_block_delta", "content_block_stop", "message_delta",
                                         "message_stop"]
    assert all(data["type"] == name for name, data in got)
    start = got[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == 11 and start["usage"]["output_tokens"] == 0
    assert [d["delta"]["text"] for n, d in got if n == "content_block_delta"] == ["Hel", "lo"]
    assert got[5][1]["delta"]["stop_reason"] == "end_turn" and got[5][1]["usage"]["output_tokens"] == 3


def test_stream_of_a_tool_use():
    request = parse(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"},
                    messages=[{"role": "user", "content": "x"}], stream=True)
    got = run_stream(request, [token(CALL[:25], 1), token(CALL[25:], 2, FinishReason.STOP)])
    names = [name for name, _ in got]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    block = got[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in got if n == "content_block_delta")
    assert json.loads(partial) == {"city": "Oslo"}
    assert {d["index"] for n, d in got if n.startswith("content_block")} == {0}
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_thinking_then_text_are_two_blocks():
    completion = Completion("chatcmpl-abc", parse(messages=[{"role": "user", "content": "x"}], stream=True), "m")
    completion.add(token("", 1, FinishReason.STOP))
    writer = API.writer(completion)

    got = events(writer.open() + writer.event(ChoiceDelta(0, True, reasoning="hm")) + writer.event(
        ChoiceDelta(0, False, content="yes", finish_reason="stop")) + writer.close())
    starts = [d["content_block"]["type"] for n, d in got if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert [d["index"] for n, d in got if n == "content_block_stop"] == [0, 1]


def test_an_error_mid_stream_is_an_error_event():
    writer = API.writer(Completion("chatcmpl-abc", parse(messages=[{"role": "user", "content": "x"}]), "m"))
    got = events(writer.error(ApiError(503, "engine restarting", error_type="server_error")))
    assert got == [("error", {"type": "error", "error": {"type": "overloaded_error",
                                                         "message": "engine restarting"}})]


def _call(method: str, path: str, **kwargs):
    async def run():
        app = web.Application()
        app[GATEWAY], refused = fake_gateway(keyed({"right": False}))
        add_routes(app)
        async with TestClient(TestServer(app)) as client:
            response = await client.request(method, path, **kwargs)
            return response.status, await response.json(), refused
    return asyncio.run(run())


def test_http_errors_on_the_messages_routes_are_in_anthropic_shape():
    status, body, _ = _call("GET", "/v1/messages")
    assert status == 405 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    status, body, refused = _call("POST", "/v1/messages", data=b"{", headers={"x-api-key": "right"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and refused == [(400, "invalid_json")]
    status, body, refused = _call("POST", "/v1/messages/count_tokens", json={}, headers={"x-api-key": "wrong"})
    assert (status, body["error"]["type"], refused) == (401, "authentication_error", [(401, "invalid_api_key")])
    status, body, _ = _call("POST", "/v1/messages", json={"model": "m", "messages": [{"role": "user",
                                                                                      "content": "x"}]},
                            headers={"x-api-key": "right"})
    assert status == 400 and "max_tokens" in body["error"]["message"]


def test_cached_prompt_tokens_are_cache_reads():
    completion = Completion("chatcmpl-abc", parse(messages=[{"role": "user", "content": "x"}]), "m")
    completion.add(token("", 1, FinishReason.STOP))
    completion.cached_tokens = 8
    usage = API.body(completion)["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (3, 8)  # 11 prompt tokens in all
