"""Issue 48.8: a streamed list of prompts on /v1/completions is one SSE stream, as OpenAI and vLLM serve it: each
chunk carries its choice's index (prompt i * n + choice j), the prompts' chunks interleaved as they come, every
choice its finish_reason, one usage chunk summed over the prompts, one [DONE]. Every prompt ends in exactly one
terminal state: a failure after the headers is the error chunk (the others aborted), before them its own HTTP
status; a client that goes away aborts them all. A real Gateway on the routes, its pool holding the jobs (no worker
connection) while the test hands each prompt its worker's report and the engine's events."""

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_engine_link import FakeEngine

from contracts.events import FinishReason, TokenEvent
from contracts.messages import PrefillDone, PrefillFailed
from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.http.routes import add_routes
from edge.state import GATEWAY
from policies.enforcer import PolicyEnforcer
from policies.loader import parse_policy

POLICY = """version = 1
default_class = "standard"
[classes.standard]
priority = 0
"""
BODY = {"model": "m", "prompt": ["one", "two"], "n": 2, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}}


class Served:
    """The gateway on an aiohttp test server; `admitted(k)` waits until k prompts were queued, in order."""

    def __init__(self, queue_limit: int = 8) -> None:
        pool = PrefillPool({"w0": "unix:/nonexistent"}, InFlightRegistry(), queue_limit=queue_limit)
        pool.workers["w0"].state = "ready"  # no connection: every job stays queued
        self.engine = FakeEngine()
        self.gateway = Gateway(ServeConfig(), "m", pool, self.engine, pool.registry, Metrics("m"),
                               PolicyEnforcer(parse_policy(POLICY, "p.toml")))
        self.ids: list[str] = []
        self.records: list = []
        self.changed = asyncio.Condition()
        submit = pool.submit

        def submitted(job):
            submit(job)
            self.ids.append(job.request_id)
            asyncio.get_running_loop().create_task(self._notify())
        pool.submit = submitted
        self.gateway.observers.append(lambda record: (self.records.append(record),
                                                      asyncio.get_running_loop().create_task(self._notify())))

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def until(self, predicate) -> None:
        async with self.changed:
            await self.changed.wait_for(predicate)

    async def admitted(self, count: int) -> list[str]:
        await self.until(lambda: len(self.ids) >= count)
        return self.ids[:count]

    async def ended(self, count: int) -> dict[str, str]:
        """request id -> its terminal status, once count requests ended."""
        await self.until(lambda: len([r for r in self.records if r.status != "rejected"]) >= count)
        return {r.request_id: r.status for r in self.records if r.status != "rejected"}

    def deliver(self, rid: str, message) -> None:
        self.gateway.registry.deliver(rid, message)


def token(rid: str, text: str, index: int, n: int, choice_finish=None, finish=None) -> TokenEvent:
    return TokenEvent(rid, (n,), text, finish, num_prompt_tokens=3, num_output_tokens=n, index=index,
                      choice_finish=choice_finish)


def done(rid: str, cached: int = 0) -> PrefillDone:
    return PrefillDone(rid, 3, 1.0, 100, 0.1, cached_tokens=cached)


async def chunk(response) -> dict | str:
    """The next server-sent event's data ("[DONE]" as it is)."""
    raw = await response.content.readuntil(b"\n\n")
    data = raw.decode().strip().removeprefix("data: ")
    return data if data == "[DONE]" else json.loads(data)


def serve(scenario, queue_limit: int = 8):
    async def run():
        served = Served(queue_limit)
        app = web.Application()
        app[GATEWAY] = served.gateway
        add_routes(app)
        async with TestClient(TestServer(app, handler_cancellation=True)) as client:
            return await scenario(client, served)
    return asyncio.run(run())


def test_the_prompts_chunks_interleave_in_one_stream_with_prompt_major_indexes_and_summed_usage():
    # (prompt, event) in the order the engine sends them: prompt 1 starts first, the choices end one by one
    script = [(1, lambda r: token(r, "B", 0, 1)), (0, lambda r: token(r, "a", 1, 1)),
              (1, lambda r: token(r, "b", 1, 1, FinishReason.STOP)), (0, lambda r: token(r, "A", 0, 1)),
              (0, lambda r: token(r, "c", 1, 2, FinishReason.LENGTH)),
              (1, lambda r: token(r, "D", 0, 2, finish=FinishReason.LENGTH)),
              (0, lambda r: token(r, "E", 0, 3, finish=FinishReason.STOP))]

    async def scenario(client, served):
        pending = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        ids = await served.admitted(2)
        served.deliver(ids[0], done(ids[0], cached=1))
        served.deliver(ids[1], done(ids[1], cached=2))
        prompt, make = script[0]
        served.deliver(ids[prompt], make(ids[prompt]))
        response = await pending
        chunks = [await chunk(response)]
        for prompt, make in script[1:]:  # each event sent once the one before it reached the client
            served.deliver(ids[prompt], make(ids[prompt]))
            chunks.append(await chunk(response))
        chunks += [await chunk(response), await chunk(response)]
        assert await response.content.read() == b""
        return ids, response, chunks, await served.ended(2)

    ids, response, chunks, ended = serve(scenario)
    assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["X-Request-Id"] == ", ".join(ids)
    texts = [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"])
             for c in chunks[:-2]]
    assert texts == [(2, "B", None), (1, "a", None), (3, "b", "stop"), (0, "A", None), (1, "c", "length"),
                     (2, "D", "length"), (0, "E", "stop")]
    assert {c["id"] for c in chunks[:-1]} == {ids[0]} and all(c["object"] == "text_completion" for c in chunks[:-1])
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 6, "completion_tokens": 3 + 2 + 2 + 1, "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 3}}
    assert chunks[-1] == "[DONE]"
    assert ended == {ids[0]: "finished", ids[1]: "finished"}


def test_without_include_usage_the_stream_ends_with_done_alone():
    async def scenario(client, served):
        pending = asyncio.ensure_future(client.post("/v1/completions", json={
            **BODY, "n": 1, "stream_options": None}))
        ids = await served.admitted(2)
        for rid in ids:
            served.deliver(rid, done(rid))
            served.deliver(rid, token(rid, "x", 0, 1, finish=FinishReason.STOP))
        response = await pending
        return [await chunk(response) for _ in range(3)], await response.content.read(), await served.ended(2)

    chunks, rest, ended = serve(scenario)
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1] and chunks[2] == "[DONE]" and rest == b""
    assert set(ended.values()) == {"finished"}


def test_a_failure_after_the_headers_is_the_error_chunk_and_the_other_prompts_are_aborted():
    async def scenario(client, served):
        pending = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        ids = await served.admitted(2)
        served.deliver(ids[0], done(ids[0]))
        served.deliver(ids[0], token(ids[0], "a", 0, 1))
        response = await pending
        first = await chunk(response)
        served.deliver(ids[1], TokenEvent.ending(ids[1], FinishReason.ERROR, "the decode step failed"))
        chunks = [first, await chunk(response), await chunk(response)]
        return ids, response, chunks, await response.content.read(), await served.ended(2), served.engine.aborted

    ids, response, chunks, rest, ended, aborted = serve(scenario)
    assert response.status == 200 and chunks[0]["choices"][0]["text"] == "a"
    assert chunks[1]["error"]["message"] and chunks[2] == "[DONE]" and rest == b""
    assert ended == {ids[0]: "aborted", ids[1]: "failed"}
    assert sorted(aborted) == sorted(ids)


def test_a_failure_before_any_event_keeps_its_http_status_and_every_prompt_ends():
    async def scenario(client, served):
        pending = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        ids = await served.admitted(2)
        served.deliver(ids[1], PrefillFailed(ids[1], "prompt_too_long", "too long", num_prompt_tokens=9000,
                                             limit=2048))
        response = await pending
        return ids, response, await response.json(), await served.ended(2), served.engine.aborted

    ids, response, body, ended, aborted = serve(scenario)
    assert response.status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert response.headers["X-Request-Id"] == ", ".join(ids)
    assert ended == {ids[0]: "aborted", ids[1]: "failed"} and sorted(aborted) == sorted(ids)


def test_a_client_that_goes_away_aborts_every_prompt():
    async def scenario(client, served):
        pending = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        ids = await served.admitted(2)
        served.deliver(ids[0], done(ids[0]))
        served.deliver(ids[0], token(ids[0], "a", 0, 1))
        response = await pending
        await chunk(response)
        response.close()  # the client leaves mid-stream: the server cancels the handler, as `edge serve`'s does
        return ids, await served.ended(2), served.engine.aborted, served.gateway.registry.requests

    ids, ended, aborted, live = serve(scenario)
    assert ended == {ids[0]: "aborted", ids[1]: "aborted"} and sorted(aborted) == sorted(ids) and not live


def test_a_prompt_refused_at_admission_is_the_answer_and_the_admitted_ones_end():
    async def scenario(client, served):
        response = await client.post("/v1/completions", json={**BODY, "prompt": ["one", "two", "three"]})
        return response, await response.json(), await served.ended(2), served.ids

    # one job went to the worker, one waits in the queue of one place: the third is refused
    response, body, ended, ids = serve(scenario, queue_limit=1)
    assert response.status == 429 and body["error"]["code"] == "queue_full"
    assert len(ids) == 2 and ended == {ids[0]: "aborted", ids[1]: "aborted"}
