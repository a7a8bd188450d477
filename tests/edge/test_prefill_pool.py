"""The prefill pool tells its listener the best priority among queued and prefilling prompts."""

import asyncio
import math

from contracts.handoff import SamplingParams
from contracts.messages import PrefillJob
from edge.core.lifecycle import InFlight, InFlightRegistry
from edge.core.prefill_pool import Entry, PrefillPool


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


def test_a_conversation_s_next_turn_goes_to_the_worker_that_holds_it():
    """Both workers free: turn 2 goes to the worker that prefilled turn 1 (its cache holds the answer's KV), not to
    the first free one; while that worker is busy, it goes to another rather than wait."""
    async def scenario():
        registry = InFlightRegistry()
        pool = PrefillPool({"w0": "unix:/nonexistent", "w1": "unix:/nonexistent"}, registry, queue_limit=8)
        for worker in pool.workers.values():
            worker.state = "ready"
        busy = Entry(0, math.inf, -1, PrefillJob("elsewhere", SamplingParams()))
        pool.workers["w0"].current = busy  # so turn 1 goes to w1
        taken = []

        def submit(request_id: str, key: bytes):
            registry.add(InFlight(request_id, 0, prefix_key=key))
            pool.submit(PrefillJob(request_id, SamplingParams(), 0))
            taken.append(registry.get(request_id).worker)

        submit("turn1", b"chat-a")
        pool.workers["w0"].current = pool.workers["w1"].current = None  # both free again
        submit("turn2", b"chat-a")  # w0 comes first in order, but w1 holds the conversation
        pool.workers["w0"].current = None
        submit("other", b"chat-b")  # no worker holds it: the first free one (w0)
        submit("turn3", b"chat-a")  # w1 is busy with turn 2: the free w0... is busy too: it waits
        queued = [entry.job.request_id for entry in pool.queue]
        pool.workers["w0"].current = None
        pool._dispatch()  # w0 frees first: it takes turn 3 rather than leave it waiting for w1
        taken.append(registry.get("turn3").worker)
        return taken, queued

    taken, queued = asyncio.run(scenario())
    assert taken == ["w1", "w1", "w0", "", "w0"] and queued == ["turn3"]
