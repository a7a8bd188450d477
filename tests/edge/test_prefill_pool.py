"""The prefill pool tells its listener the best priority among queued and prefilling prompts."""

import asyncio

from contracts.handoff import SamplingParams
from contracts.messages import PrefillJob
from edge.core.lifecycle import InFlight, InFlightRegistry
from edge.core.prefill_pool import PrefillPool


def test_best_priority_is_announced_on_every_change():
    async def scenario():
        registry = InFlightRegistry()
        heard = []
        # no workers: everything stays queued
        pool = PrefillPool({}, registry, queue_limit=8, on_best_priority=heard.append)
        for request_id, priority in (("bg-1", 10), ("bg-2", 10), ("fg", 0)):
            registry.add(InFlight(request_id, priority))
            pool.submit(PrefillJob(request_id, SamplingParams(), priority))
        await pool.cancel("fg")
        await pool.cancel("bg-1")
        await pool.cancel("bg-2")
        return heard

    assert asyncio.run(scenario()) == [10, 0, 10, None]



def test_a_backlog_is_announced_only_while_prompts_wait_for_a_busy_ready_worker():
    async def scenario():
        registry = InFlightRegistry()
        heard = []
        # no engine can take a job: submitted jobs stay queued
        pool = PrefillPool({"w": "unix:/nonexistent"}, registry, queue_limit=8, on_backlog=heard.append,
                           choose_engine=lambda request_id: None)
        for request_id in ("a", "b"):
            registry.add(InFlight(request_id, 0))
        pool.submit(PrefillJob("a", SamplingParams(), 0))
        steps = [list(heard)]  # queued, no worker ready: nothing prefills, so nothing waits for a worker
        worker = pool.workers["w"]
        worker.state = "ready"
        pool.submit(PrefillJob("b", SamplingParams(), 0))
        steps.append(list(heard))  # a ready worker, idle: not a backlog
        worker.current = pool.queue[0]  # busy now (as if it had taken a job)
        pool._announce()
        steps.append(list(heard))
        await pool.cancel("a")
        await pool.cancel("b")
        steps.append(list(heard))  # nothing waits any more
        return steps

    assert asyncio.run(scenario()) == [[], [], [True], [True, False]]
