"""Responses' store and previous_response_id (issue 48.10): a bounded per-key store (edge.api.response_store), the
parser continuing a stored conversation, and the route's lookup under the request's own key."""

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_gateway import fake_gateway, keyed

from contracts.events import FinishReason, TokenEvent
from edge.api.completion import Completion
from edge.api.response_store import ResponseStore
from edge.api.responses import ResponsesApi
from edge.http.routes import add_routes
from edge.state import GATEWAY, RESPONSES
from policies.quota import key_id

API = ResponsesApi()
ITEMS = ({"type": "message", "role": "user", "content": "hi"},)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_store_is_per_key_bounded_expiring_and_least_recently_used_first():
    clock = Clock()
    store = ResponseStore(max_per_key=2, max_total=3, ttl_s=10.0, clock=clock)
    store.put("a", "r1", ITEMS)
    store.put("a", "r2", ITEMS)
    assert store.get("b", "r1") is None and store.get("a", "r1") == ITEMS  # another key never reads it
    store.put("a", "r3", ITEMS)  # a's third: its least recently used (r2, since r1 was just read) goes
    assert store.get("a", "r2") is None and store.get("a", "r1") == ITEMS and store.get("a", "r3") == ITEMS
    store.put("b", "r4", ITEMS)
    store.put("c", "r5", ITEMS)  # four in all: the least recently used of every key goes
    assert len(store.entries) == 3 and store.get("a", "r1") is None
    clock.now = 10.0
    assert store.get("c", "r5") is None and store.num_per_key.get("c") is None  # expired
    assert store.delete("b", "r4") and not store.delete("b", "r4")


def test_a_follow_up_continues_the_stored_items_and_store_false_keeps_nothing():
    first = API.parse({"model": "m", "input": "What is 2+2?"}, None)
    completion = Completion("chatcmpl-abc", first, "m")
    completion.add(TokenEvent("chatcmpl-abc", (1,), "4", FinishReason.STOP, num_prompt_tokens=5, num_output_tokens=1))
    response_id, items = API.stored(completion)
    assert response_id == "resp_abc" and [item["type"] for item in items] == ["message", "message"]
    follow = API.parse({"model": "m", "input": "And 3+3?", "previous_response_id": response_id}, None, None, items)
    assert [(m["role"], m["content"]) for m in follow.messages] == [("user", "What is 2+2?"), ("assistant", "4"),
                                                                   ("user", "And 3+3?")]
    assert follow.previous_response_id == response_id and len(follow.history) == 3
    unkept = API.parse({"model": "m", "input": "x", "store": False}, None)
    assert API.stored(Completion("chatcmpl-x", unkept, "m")) is None
    assert API.body(completion)["store"] is True and API.body(Completion("chatcmpl-x", unkept, "m"))["store"] is False


def test_the_route_looks_up_under_the_requests_own_key():
    async def scenario():
        app = web.Application()
        app[GATEWAY], _ = fake_gateway(keyed({"key-a": False, "key-b": False}))
        add_routes(app)
        app[RESPONSES].put(key_id("key-a"), "resp_1", ITEMS)
        body = {"model": "m", "input": "more", "previous_response_id": "resp_1"}
        async with TestClient(TestServer(app)) as client:
            out = []
            for key, rid in (("key-b", "resp_1"), ("key-a", "resp_2"), ("key-a", "resp_1")):
                response = await client.post("/v1/responses", json={**body, "previous_response_id": rid},
                                             headers={"Authorization": f"Bearer {key}"})
                out.append((response.status, (await response.json())["error"]))
            deleted = [(await client.delete("/v1/responses/resp_1", headers={"Authorization": f"Bearer {k}"})).status
                       for k in ("key-b", "key-a", "key-a")]
            return out, deleted
    out, deleted = asyncio.run(scenario())
    assert [(status, error["code"]) for status, error in out[:2]] == [(404, "previous_response_not_found")] * 2
    assert out[0][1]["param"] == "previous_response_id"
    assert out[2][0] == 503  # found: on to admission (no worker is ready here)
    assert deleted == [404, 200, 404]
