"""The model registry's rules (issue 45) on fake stacks (no processes): load on demand, LRU idle eviction within the
budget (never a busy or pinned model), 503 model_capacity with Retry-After, keep_alive (0, a duration, forever, a
request's own), a failed load isolated, load waits let through in priority order, the load timeout."""

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from contracts.memory_plan import MemoryRefused
from edge.api.fields import ApiError
from edge.models.registry import FAILED, LOADED, UNLOADED, LoadFailed, ModelRegistry
from edge.models.spec import FOREVER, ModelSpec


class FakeStack:
    def __init__(self, spec: ModelSpec, events: list, gate: asyncio.Event | None = None, fail: str = "") -> None:
        self.spec, self.events, self.gate, self.fail = spec, events, gate, fail
        self.gateway = SimpleNamespace(model_name=spec.name)
        self.requests = 0  # accepted by its gateway and not ended

    async def start(self) -> None:
        self.events.append(("start", self.spec.name))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise LoadFailed(self.fail)

    async def stop(self) -> None:
        self.events.append(("stop", self.spec.name))

    def in_flight(self) -> int:
        return self.requests

    def memory(self) -> dict:
        return {"rss": 1 << 20, "pss": 1 << 20}


def spec(name: str, keep_alive_s: float = FOREVER, pinned: bool = False) -> ModelSpec:
    return ModelSpec(name, f"/models/{name}.gguf", (), keep_alive_s, pinned)


def registry(*specs: ModelSpec, budget: int | None = 200, cost: int = 100, gates=None, fail=None, timeout_s=30.0,
             refused=()):
    events: list = []
    stacks: dict[str, FakeStack] = {}

    def make(s: ModelSpec) -> FakeStack:
        stacks[s.name] = FakeStack(s, events, (gates or {}).get(s.name), (fail or {}).get(s.name, ""))
        return stacks[s.name]

    def plan(s: ModelSpec) -> dict[str, int]:
        if s.name in refused:
            raise MemoryRefused(f"{s.name} does not fit the memory budget even with one weight set")
        return {"host": cost}
    counter = itertools.count()
    models = ModelRegistry(specs, make, plan, None if budget is None else {"host": budget}, timeout_s,
                           clock=lambda: float(next(counter)))
    return models, events, stacks


def state_reached(models: ModelRegistry, name: str, state: str) -> asyncio.Future:
    """A future set once the model reaches the state (the registry's change listener: no sleeping)."""
    future = asyncio.get_running_loop().create_future()

    def listen(changed: str, now: str) -> None:
        if changed == name and now == state and not future.done():
            future.set_result(None)
    models.on_change.append(listen)
    return future


async def use(models: ModelRegistry, name: str, **kw) -> None:
    await models.acquire(name, **kw)
    models.release(name)


def test_a_model_loads_on_its_first_request_and_serves_the_next_ones_loaded():
    async def scenario():
        models, events, _ = registry(spec("a"))
        assert models.slots["a"].state == UNLOADED
        stack = await models.acquire("a")
        assert models.slots["a"].state == LOADED and stack.gateway.model_name == "a"
        models.release("a")
        await use(models, "a")
        return events
    assert asyncio.run(scenario()) == [("start", "a")]


def test_the_least_recently_used_idle_model_is_evicted_first():
    async def scenario():
        models, events, _ = registry(spec("a"), spec("b"), spec("c"))
        await use(models, "a")
        await use(models, "b")
        await use(models, "a")  # b is now the least recently used
        await use(models, "c")
        return events, {n: s.state for n, s in models.slots.items()}
    events, states = asyncio.run(scenario())
    assert ("stop", "b") in events and ("stop", "a") not in events
    assert events.index(("stop", "b")) < events.index(("start", "c"))  # its memory first
    assert states == {"a": LOADED, "b": UNLOADED, "c": LOADED}


def test_nothing_evictable_is_a_503_model_capacity_with_retry_after():
    async def scenario():
        models, events, stacks = registry(spec("a", pinned=True), spec("b"), spec("c"), budget=200)
        await models.start()
        await models.acquire("b")  # held
        with pytest.raises(ApiError) as refused:
            await models.acquire("c")
        stacks["b"].requests = 1
        models.release("b")  # its lease is back, but its gateway still has a request in flight
        with pytest.raises(ApiError) as again:
            await models.acquire("c")
        return refused.value, again.value, events, {n: s.state for n, s in models.slots.items()}
    err, again, events, states = asyncio.run(scenario())
    for refusal in (err, again):
        assert refusal.status == 503 and refusal.code == "model_capacity"
        assert int(refusal.headers["Retry-After"]) > 0 and "'c'" in refusal.message
    assert "a (pinned)" in err.message and "b (busy)" in err.message
    assert not any(kind == "stop" for kind, _ in events)
    assert states == {"a": LOADED, "b": LOADED, "c": UNLOADED}


def test_an_idle_one_beside_a_pinned_one_is_evicted():
    async def scenario():
        models, events, _ = registry(spec("a", pinned=True), spec("b"), spec("c"), budget=200)
        await models.start()
        await use(models, "a")
        await use(models, "b")
        await use(models, "c")  # a is the least recently used, but pinned: b goes
        return events, {n: s.state for n, s in models.slots.items()}
    events, states = asyncio.run(scenario())
    assert ("stop", "b") in events and ("stop", "a") not in events
    assert states == {"a": LOADED, "b": UNLOADED, "c": LOADED}


def test_keep_alive_zero_unloads_once_the_answer_is_out():
    async def scenario():
        models, events, _ = registry(spec("a", keep_alive_s=0.0))
        await models.acquire("a")
        assert models.slots["a"].state == LOADED  # not while its request runs
        unloaded = state_reached(models, "a", UNLOADED)
        models.release("a")
        await asyncio.wait_for(unloaded, 5)
        return events
    assert asyncio.run(scenario()) == [("start", "a"), ("stop", "a")]


def test_keep_alive_duration_unloads_after_that_long_idle_and_a_request_rearms_it():
    async def scenario():
        models, events, _ = registry(spec("a", keep_alive_s=0.05))
        await use(models, "a")
        slot = models.slots["a"]
        assert slot.timer is not None and slot.expires_at is not None
        await models.acquire("a")  # a request meanwhile: no timer while it runs
        assert slot.timer is None and slot.expires_at is None and slot.state == LOADED
        unloaded = state_reached(models, "a", UNLOADED)
        models.release("a")
        await asyncio.wait_for(unloaded, 5)
        return events, models.describe()[0]
    events, described = asyncio.run(scenario())
    assert events == [("start", "a"), ("stop", "a")]
    assert described["state"] == UNLOADED and described["expires_at"] is None and described["loaded_at"] is None


def test_keep_alive_forever_and_pinned_never_unload_for_idleness():
    async def scenario():
        models, events, _ = registry(spec("a", keep_alive_s=FOREVER), spec("b", keep_alive_s=0.0, pinned=True),
                                     budget=None)
        await use(models, "a")
        await use(models, "b")
        slots = models.slots
        return events, [(s.state, s.timer, s.expires_at) for s in slots.values()], models.describe()
    events, states, described = asyncio.run(scenario())
    assert states == [(LOADED, None, None), (LOADED, None, None)]
    assert not any(kind == "stop" for kind, _ in events)
    assert described[0]["keep_alive"] is None  # forever


def test_a_requests_keep_alive_replaces_the_models_until_it_unloads():
    async def scenario():
        models, events, _ = registry(spec("a", keep_alive_s=FOREVER))
        unloaded = state_reached(models, "a", UNLOADED)
        await models.acquire("a", keep_alive_s=0.0)
        models.release("a")
        await asyncio.wait_for(unloaded, 5)
        return events, models.slots["a"].keep_alive_s
    events, keep_alive_s = asyncio.run(scenario())
    assert events == [("start", "a"), ("stop", "a")] and keep_alive_s == FOREVER  # the model's own again


def test_a_failed_load_fails_alone_with_its_reason_and_an_operator_may_retry():
    async def scenario():
        models, events, _ = registry(spec("bad"), spec("good"), fail={"bad": "prefill-0 exited with signal SIGABRT"})
        with pytest.raises(ApiError) as failed:
            await models.acquire("bad")
        with pytest.raises(ApiError) as again:  # no new load: the reason stands
            await models.acquire("bad")
        await use(models, "good")
        with pytest.raises(ApiError):
            await models.load("bad")  # an operator's retry loads it again (and it fails again)
        return failed.value, again.value, events, {d["name"]: (d["state"], d["error"]) for d in models.describe()}
    failed, again, events, described = asyncio.run(scenario())
    assert failed.status == 503 and failed.code == "model_failed" and "SIGABRT" in failed.message
    assert again.code == "model_failed"
    assert events.count(("start", "bad")) == 2 and events.count(("stop", "bad")) == 2  # the retry's, and stopped
    assert described["good"] == (LOADED, None) and described["bad"][0] == FAILED and "SIGABRT" in described["bad"][1]


def test_a_model_that_cannot_fit_even_alone_fails_with_the_plans_reason():
    async def scenario():
        models, events, _ = registry(spec("huge"), refused=("huge",))
        with pytest.raises(ApiError) as failed:
            await models.acquire("huge")
        return failed.value, events
    failed, events = asyncio.run(scenario())
    assert failed.code == "model_failed" and "does not fit the memory budget" in failed.message and events == []


def test_requests_waiting_for_a_load_go_through_in_priority_order():
    async def scenario():
        gate = asyncio.Event()
        models, _, _ = registry(spec("a"), gates={"a": gate})
        order: list[int] = []

        async def request(priority: int) -> None:
            await models.acquire("a", priority=priority)
            order.append(priority)
            models.release("a")
        tasks = []
        for priority in (5, 0, 3, -2):
            tasks.append(asyncio.create_task(request(priority)))
            await asyncio.sleep(0)  # each queued in this order
        while len(models.slots["a"].waiters) < 4:
            await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks)
        return order, models.slots["a"].leases
    order, leases = asyncio.run(scenario())
    assert order == [-2, 0, 3, 5] and leases == 0


def test_a_load_that_takes_longer_than_the_timeout_is_a_503_and_fails():
    async def scenario():
        models, events, _ = registry(spec("slow"), gates={"slow": asyncio.Event()}, timeout_s=0.05)
        with pytest.raises(ApiError) as waited:
            await models.acquire("slow")
        failed = state_reached(models, "slow", FAILED)
        if models.slots["slow"].state != FAILED:
            await asyncio.wait_for(failed, 5)
        return waited.value, models.describe()[0]
    waited, described = asyncio.run(scenario())
    assert waited.status == 503 and waited.code in ("model_loading", "model_failed")
    assert described["state"] == FAILED and "model_load_timeout_s" in described["error"]


def test_an_operator_unload_refuses_a_busy_model_and_unloads_a_pinned_one():
    async def scenario():
        models, events, _ = registry(spec("a", pinned=True), budget=None)
        await models.acquire("a")
        with pytest.raises(ApiError) as busy:
            await models.unload("a")
        models.release("a")
        described = await models.unload("a")
        return busy.value, described, events
    busy, described, events = asyncio.run(scenario())
    assert busy.status == 409 and busy.code == "model_busy"
    assert described["state"] == UNLOADED and events == [("start", "a"), ("stop", "a")]


def test_close_stops_every_loaded_model():
    async def scenario():
        models, events, _ = registry(spec("a"), spec("b"), budget=None)
        await use(models, "a")
        await use(models, "b")
        await models.close()
        with pytest.raises(ApiError) as closing:
            await models.acquire("a")
        return events, closing.value
    events, closing = asyncio.run(scenario())
    assert sorted(e for e in events if e[0] == "stop") == [("stop", "a"), ("stop", "b")]
    assert closing.code == "shutting_down"


def test_a_model_unloading_for_idleness_makes_room_for_the_next_load():
    async def scenario():
        models, events, _ = registry(spec("a", keep_alive_s=0.0), spec("b"), budget=100)
        gate = asyncio.Event()
        original = models.make_stack

        def slow_stop(s):
            stack = original(s)
            if s.name == "a":
                async def stop():
                    await gate.wait()  # a's processes take their time to exit
                    events.append(("stop", "a"))
                stack.stop = stop
            return stack
        models.make_stack = slow_stop
        await use(models, "a")  # keep_alive 0: a is unloading now
        assert models.slots["a"].state == "unloading"
        loading = asyncio.create_task(models.acquire("b"))  # waits for a's memory, no 503
        while models.slots["b"].state != "loading":
            await asyncio.sleep(0)
        assert ("start", "b") not in events
        gate.set()
        await loading
        return events
    events = asyncio.run(scenario())
    assert events == [("start", "a"), ("stop", "a"), ("start", "b")]
