"""/health's engine parts come from the engine link (edge.core.engine_link): each single engine by name as a
component (its error beside), and a group's table of engines where the link describes one."""

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_engine_link import FakeEngine
from fake_gateway import fake_gateway

from edge.http.routes import add_routes
from edge.state import GATEWAY


class TwoEngines(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = FakeEngine("ready"), FakeEngine("down")
        self.second.last_error = "refused the handshake"

    def links(self) -> dict:
        return {"decode-0": self.first, "decode-1": self.second}

    def describe(self) -> dict:
        return {"decode-0": {"state": "ready"}, "decode-1": {"state": "down"}}


def health(engine, embedding_only: bool = False) -> dict:
    async def scenario():
        app = web.Application()
        app[GATEWAY], _ = fake_gateway()
        app[GATEWAY].engine, app[GATEWAY].embedding_only = engine, embedding_only
        add_routes(app)
        async with TestClient(TestServer(app)) as client:
            return await (await client.get("/health")).json()
    return asyncio.run(scenario())


def test_each_linked_engine_is_a_component_and_a_group_adds_its_table():
    body = health(TwoEngines())
    assert body["components"] == {"decode-0": "ready", "decode-1": "down"}
    assert body["errors"] == {"decode-1": "refused the handshake"}
    assert body["engines"] == {"decode-0": {"state": "ready"}, "decode-1": {"state": "down"}}


def test_one_engine_has_no_table_and_an_embedding_model_no_engine():
    one = FakeEngine("connecting")
    one.links = lambda: {"decode_engine": one}
    body = health(one)
    assert body["components"] == {"decode_engine": "connecting"} and "engines" not in body
    assert health(TwoEngines(), embedding_only=True)["components"] == {}
    assert health(TwoEngines())["structured_outputs"]["compiles"] == 0  # the app's grammar checks, none yet


def test_metrics_answers_with_the_mirrored_gauges_and_the_route_counters():
    async def scenario():
        app = web.Application()
        app[GATEWAY], _ = fake_gateway()
        add_routes(app)
        async with TestClient(TestServer(app)) as client:
            refused = await client.post("/v1/responses", data=b"{")
            response = await client.get("/metrics")
            return refused.status, response.status, await response.text()
    refused, status, text = asyncio.run(scenario())
    assert (refused, status) == (400, 200)
    assert 'edge:api_requests_total{model_name="m",route="/v1/responses",status="rejected"} 1.0' in text
    assert "edge:kv_cache_blocks_used" in text and "edge:prefill_queue_length" in text


def test_each_app_holds_its_own_grammar_checks_and_its_drain_closes_them(tmp_path):
    import edge.app
    from edge.config import ServeConfig
    from edge.state import GRAMMAR_CHECKS

    first, second = (edge.app.make_app(ServeConfig(launch=False, run_dir=str(tmp_path))) for _ in range(2))
    assert first[GRAMMAR_CHECKS] is not second[GRAMMAR_CHECKS]  # no process-wide checks shared between apps
    first[GRAMMAR_CHECKS].check(None)  # a model's compile processes made (not started: nothing compiled yet)
    asyncio.run(edge.app._drain(first))
    assert first[GRAMMAR_CHECKS].checks == {} and second[GRAMMAR_CHECKS].checks == {}
    fallback = web.Application()
    fallback[GATEWAY], _ = fake_gateway()
    add_routes(fallback)  # an app built without edge.app gets checks of its own
    assert fallback[GRAMMAR_CHECKS] is not first[GRAMMAR_CHECKS] and fallback[GRAMMAR_CHECKS] is not None


def test_health_reports_each_processs_memory():
    """The gateway's own RSS and PSS at least (no supervisor, no plan here: edge serve adds its children and plan)."""
    import os
    memory = health(FakeEngine("ready"))["memory"]
    gateway = memory["processes"]["gateway"]
    assert gateway["pid"] == os.getpid() and gateway["rss"] > 10 << 20 and memory["total"]["rss"] >= gateway["rss"]
