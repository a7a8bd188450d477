"""The prefill pool tells its listener the best priority among queued and prefilling prompts."""

import asyncio

from edge.lifecycle import InFlight, InFlightRegistry
from edge.prefill_pool import PrefillPool
from contracts.handoff import SamplingParams
from contracts.messages import PrefillJob


def test_best_priority_is_announced_on_every_change():
    async def scenario():
        registry = InFlightRegistry()
        pool = PrefillPool({}, registry, queue_limit=8)  # no workers: everything stays queued
        heard = []
        pool.on_best_priority = heard.append
        for request_id, priority in (("bg-1", 10), ("bg-2", 10), ("fg", 0)):
            registry.add(InFlight(request_id, priority))
            pool.submit(PrefillJob(request_id, SamplingParams(), priority))
        await pool.cancel("fg")
        await pool.cancel("bg-1")
        await pool.cancel("bg-2")
        return heard

    assert asyncio.run(scenario()) == [10, 0, 10, None]
