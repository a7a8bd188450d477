"""The one answer path every client API takes (edge.http.stream): the headers wait for the first engine event, so an
early failure keeps its status and the API's error body; a failure after them travels in the API's stream; a
collected answer is the API's body. Driven by a fake gateway that hands out events or fails."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict

from contracts.events import FinishReason, TokenEvent
from edge.api.chat_completions import ChatCompletionsApi
from edge.api.completion import Completion
from edge.api.completions import CompletionsApi
from edge.api.messages import MessagesApi
from edge.api.openai_request import ApiError
from edge.api.responses import ResponsesApi
from edge.http.stream import collect, stream

BODIES = {"chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
          "completion": {"model": "m", "prompt": "hi"},
          "responses": {"model": "m", "input": "hi"},
          "messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}}
APIS = {"chat": ChatCompletionsApi(), "completion": CompletionsApi(), "responses": ResponsesApi(),
        "messages": MessagesApi()}
FAILED = ApiError(503, "the decode engine restarted", error_type="server_error", code="engine_unavailable",
                  headers={"Retry-After": "2"})


class FakeGateway:
    """Hands out the events in order; an ApiError among them is raised instead."""

    def __init__(self, events: list) -> None:
        self.events = list(events)

    async def next_event(self, run):
        event = self.events.pop(0)
        if isinstance(event, ApiError):
            raise event
        return event


def token(text: str, n: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent("r-1", (n,), text, finish, num_prompt_tokens=5, num_output_tokens=n)


def answer(name: str, events: list, streamed: bool) -> tuple[int, CIMultiDict, bytes, Completion]:
    api = APIS[name]
    request = api.parse({**BODIES[name], "stream": streamed}, None)
    completion = Completion("r-1", request, "m")
    run = SimpleNamespace(headers={"X-Request-Id": "r-1"}, prompt_logprobs=None, cached_tokens=0, request=request)

    async def handler(http: web.Request) -> web.StreamResponse:
        gateway = FakeGateway(events)
        return await (stream(http, gateway, run, completion, api) if streamed else collect(gateway, run, completion,
                                                                                          api))

    async def scenario():
        app = web.Application()
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as client:
            response = await client.post("/")
            return response.status, CIMultiDict(response.headers), await response.read()
    status, headers, raw = asyncio.run(scenario())
    return status, headers, raw, completion


def sse_data(raw: bytes) -> list:
    """Each event's data, parsed ("[DONE]" as it is)."""
    out = []
    for block in raw.decode().strip().split("\n\n"):
        data = next(line[6:] for line in block.split("\n") if line.startswith("data: "))
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("name", sorted(APIS))
@pytest.mark.parametrize("streamed", [True, False])
def test_a_failure_before_the_first_event_keeps_its_status_and_the_apis_error_body(name, streamed):
    status, headers, raw, completion = answer(name, [FAILED], streamed)
    assert (status, headers["Retry-After"], headers["X-Request-Id"]) == (503, "2", "r-1")
    assert headers["Content-Type"].startswith("application/json") and completion.error is FAILED
    body = json.loads(raw)
    if name == "messages":
        assert body == {"type": "error", "error": {"type": "overloaded_error", "message": FAILED.message}}
    else:
        assert body["error"]["code"] == "engine_unavailable"


@pytest.mark.parametrize("name, last", [("chat", "[DONE]"), ("completion", "[DONE]"),
                                        ("responses", "response.failed"), ("messages", "error")])
def test_a_failure_after_the_headers_travels_in_the_apis_stream_then_it_ends(name, last):
    status, headers, raw, completion = answer(name, [token("Hi", 1), FAILED], streamed=True)
    assert status == 200 and headers["Content-Type"] == "text/event-stream" and headers["X-Request-Id"] == "r-1"
    events = sse_data(raw)
    assert events[-1] == last or events[-1]["type"] == last
    assert "Hi" in raw.decode()  # what came before the failure went out
    assert completion.error is FAILED and completion.finish_reason is None


@pytest.mark.parametrize("name", sorted(APIS))
def test_a_streamed_answer_and_a_collected_one_say_the_same(name):
    events = [token("Hel", 1), token("lo", 2), token("", 3, FinishReason.STOP)]
    _, _, raw, streamed = answer(name, events, streamed=True)
    status, _, body, collected = answer(name, events, streamed=False)
    assert status == 200 and streamed.finish_reason == collected.finish_reason == "stop"
    assert "Hello" in json.dumps(json.loads(body))
    assert "Hel" in raw.decode() and "lo" in raw.decode()
    if name in ("chat", "completion"):
        assert sse_data(raw)[-1] == "[DONE]"
