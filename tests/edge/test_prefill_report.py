"""The engine sends a request's first token as its handoff lands, before the prefill worker reports the prefill,
so a one-token answer can end before its PrefillDone arrives. The request waits a moment for that report: its usage
(cached tokens) and the worker's prefix-cache metrics come from it (the flaky CI test of the per-key prompt cache
lost exactly these hits)."""

import asyncio

import pytest
from aiohttp.test_utils import make_mocked_request
from fake_engine_link import FakeEngine

import edge.core.request_events
from contracts.events import FinishReason, TokenEvent
from contracts.messages import PrefillDone
from edge.api.openai_request import ApiError, parse_request
from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry, RequestStatus
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from policies.enforcer import PolicyEnforcer
from policies.loader import parse_policy

POLICY = """version = 1
default_class = "standard"
[classes.standard]
priority = 0
"""


def admitted():
    pool = PrefillPool({"w0": "unix:/nonexistent"}, InFlightRegistry(), queue_limit=4)
    pool.workers["w0"].state = "ready"  # no connection: the job is never sent
    gateway = Gateway(ServeConfig(), "m", pool, FakeEngine(), pool.registry, Metrics("m"),
                      PolicyEnforcer(parse_policy(POLICY, "p.toml")))
    http = make_mocked_request("POST", "/v1/completions")
    run = gateway.admit(http, parse_request({"model": "m", "prompt": [7] * 400, "max_tokens": 1}, "completion"))
    return gateway, run


def worker_hits(gateway):
    return gateway.metrics.registry.get_sample_value("vllm:prefix_cache_hits_total",
                                                     {"model_name": "m", "where": "worker"})


def test_a_report_arriving_after_the_last_token_still_counts():
    async def scenario():
        gateway, run = admitted()
        rid = run.inflight.request_id
        gateway.registry.deliver(rid, TokenEvent(rid, (5,), "x", FinishReason.LENGTH, num_prompt_tokens=400,
                                                 num_output_tokens=1))
        asyncio.get_running_loop().call_later(0.05, gateway.registry.deliver, rid,
                                              PrefillDone(rid, 400, 20.0, 1000, 1.0, cached_tokens=360))
        event = await gateway.next_event(run)
        return gateway, run, event

    gateway, run, event = asyncio.run(scenario())
    assert event.finish_reason == FinishReason.LENGTH and event.token_ids == (5,)
    assert run.cached_tokens == 360 and worker_hits(gateway) == 360


def test_a_report_that_never_comes_delays_the_end_only_briefly(monkeypatch):
    monkeypatch.setattr(edge.core.request_events, "PREFILL_REPORT_WAIT_S", 0.2)

    async def scenario():
        gateway, run = admitted()
        rid = run.inflight.request_id
        gateway.registry.deliver(rid, TokenEvent(rid, (5,), "x", FinishReason.STOP, num_prompt_tokens=400,
                                                 num_output_tokens=1))
        loop = asyncio.get_running_loop()
        started = loop.time()
        event = await gateway.next_event(run)
        return run, event, loop.time() - started

    run, event, waited = asyncio.run(scenario())
    assert event.finish_reason == FinishReason.STOP and run.cached_tokens == 0 and 0.15 <= waited < 1.0


def test_a_failed_request_does_not_wait_for_a_report():
    async def scenario():
        gateway, run = admitted()
        rid = run.inflight.request_id
        gateway.registry.deliver_ending(rid, FinishReason.ABORT, "shutting down")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ApiError) as failed:
            await gateway.next_event(run)
        return failed.value, loop.time() - started

    failed, waited = asyncio.run(scenario())
    assert (failed.status, failed.code) == (503, "aborted") and waited < 0.1


def prompt_tokens_counted(gateway):
    return gateway.metrics.registry.get_sample_value("vllm:prompt_tokens_total", {"model_name": "m"})


@pytest.mark.parametrize("prompt, expected", [([7] * 400, 400), ("word " * 100, 125)])
def test_a_request_abandoned_in_prefill_counts_its_prompt(prompt, expected):
    """The client went away while a worker computed its prompt: the record (quotas, audit) and /metrics count that
    prompt, exactly when it came as tokens, else as estimated from its text (4 bytes a token before any prefill)."""
    async def scenario():
        pool = PrefillPool({"w0": "unix:/nonexistent"}, InFlightRegistry(), queue_limit=4)
        pool.workers["w0"].state = "ready"  # no connection: the job is never sent
        gateway = Gateway(ServeConfig(), "m", pool, FakeEngine(), pool.registry, Metrics("m"),
                          PolicyEnforcer(parse_policy(POLICY, "p.toml")))
        records = []
        gateway.observers.append(records.append)
        http = make_mocked_request("POST", "/v1/completions")
        run = gateway.admit(http, parse_request({"model": "m", "prompt": prompt, "max_tokens": 4}, "completion"))
        assert run.inflight.status == RequestStatus.PREFILLING
        await gateway.end(run, RequestStatus.ABORTED, "abort")
        return gateway, records

    gateway, records = asyncio.run(scenario())
    assert [(r.status, r.prompt_tokens) for r in records] == [("aborted", expected)]
    assert prompt_tokens_counted(gateway) == expected


def test_a_request_abandoned_in_the_queue_counts_no_prompt():
    async def scenario():
        gateway, run = admitted()
        queued = gateway.admit(make_mocked_request("POST", "/v1/completions"),
                               parse_request({"model": "m", "prompt": [7] * 40, "max_tokens": 1}, "completion"))
        records = []
        gateway.observers.append(records.append)
        await gateway.end(queued, RequestStatus.ABORTED, "abort")  # the one worker was busy: nothing computed it
        return records
    assert [r.prompt_tokens for r in asyncio.run(scenario())] == [0]
