"""Embeddings and rerank jobs need no decode engine: the pool dispatches them while the engine is away, the gateway
queues them while it is not ready, and a too-long input names 'input'."""

import asyncio

import pytest
from fake_engine_link import FakeEngine

from contracts.handoff import SamplingParams
from contracts.messages import PrefillFailed, PrefillJob
from edge.api.openai_request import parse_request
from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlight, InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.core.run import Run
from policies.enforcer import Decision, PolicyEnforcer
from policies.schema import Policy


def _pool_with_a_worker(engine_connected: bool) -> tuple[PrefillPool, InFlightRegistry, list]:
    registry = InFlightRegistry()
    pool = PrefillPool({"w": "unix:/nonexistent"}, registry, queue_limit=8,
                       choose_engine=lambda request_id: None)  # no engine is ready
    sent = []

    async def send(worker, frame):
        sent.append(frame)
    pool._send_frame = send
    worker = pool.workers["w"]
    worker.state, worker.engine_connected = "ready", engine_connected
    return pool, registry, sent


@pytest.mark.parametrize("engine_connected", [True, False])
def test_an_embeddings_job_goes_to_a_worker_while_no_engine_is_ready(engine_connected):
    async def scenario():
        pool, registry, sent = _pool_with_a_worker(engine_connected)
        for request_id in ("gen", "emb"):
            registry.add(InFlight(request_id, 0))
        pool.submit(PrefillJob("gen", SamplingParams(), 0))  # better placed (earlier), but it needs an engine
        pool.submit(PrefillJob("emb", SamplingParams(max_tokens=0), 0, task="embed", embed_texts=("x",)))
        await asyncio.sleep(0)
        return pool, sent

    pool, sent = asyncio.run(scenario())
    assert pool.workers["w"].current.job.request_id == "emb" and len(sent) == 1
    assert [entry.job.request_id for entry in pool.queue] == ["gen"]  # still waiting for an engine, in its place


def _gateway(ready_workers: int, embedding_only: bool = False) -> Gateway:
    registry = InFlightRegistry()
    pool = PrefillPool({f"w{i}": "unix:/nonexistent" for i in range(ready_workers)}, registry, queue_limit=8)
    for worker in pool.workers.values():
        worker.state = "ready"
    gateway = Gateway(ServeConfig(), "m", pool, FakeEngine(state="connecting"), registry, Metrics("m"),
                      PolicyEnforcer(Policy("test")))
    gateway.embedding_only = embedding_only
    return gateway


def test_readiness_asks_for_an_engine_only_where_one_serves():
    assert not _gateway(1).ready and _gateway(1, embedding_only=True).ready
    assert not _gateway(0, embedding_only=True).ready
    err = _gateway(0, embedding_only=True)._not_ready_error()
    assert err.status == 503 and "decode engine" not in err.message


def test_a_too_long_input_names_input():
    async def scenario():
        gateway = _gateway(1)
        inflight = InFlight("embd-1", 0)
        inflight.events.put_nowait(PrefillFailed("embd-1", "prompt_too_long", "an input has 900 tokens", 900, 512))
        decision = Decision("default", 0, 0, None, 512, "", "normal", (), ("", ""))
        run = Run(inflight, parse_request({"model": "m", "prompt": "x"}, "completion"), decision, float("inf"))
        with pytest.raises(Exception) as caught:
            await gateway.embeddings(run)
        return caught.value

    err = asyncio.run(scenario())
    assert err.status == 400 and err.param == "input" and err.code == "context_length_exceeded"
    assert "messages" not in err.message and "900" in err.message

