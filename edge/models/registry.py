"""The configured models and which of them are loaded (issue 45): one gateway process, one port, a stack of processes
per loaded model (edge.models.stack), loaded on a request's demand within the memory budget and unloaded when idle or
evicted.

The rules, in one place:
- a request for a model that is not loaded starts its load and waits for it (model_load_timeout_s); requests waiting
  for one load are let through in priority order (lower first) when it ends;
- before a load, the model's memory plan (contracts/memory_plan.py, `cost`) must fit beside what the loaded and
  loading models were planned to take; the least recently used idle models are unloaded first; a model with requests
  in flight, or `pinned`, never is; when nothing can go: 503 model_capacity with Retry-After;
- keep_alive (Ollama's meaning, edge.models.spec): 0 unloads once the last answer is out, a duration after that long
  idle, FOREVER never; a request's own keep_alive replaces the model's for what follows it; pinned models are loaded
  at start and never unloaded but by an operator;
- a load that fails leaves the model `failed` with its reason (503 naming it) until an operator loads it again; the
  other models serve on.

Everything here runs on the event loop; loading and unloading are tasks, so no other model's request waits for them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from contracts.tasks import spawn
from edge.api.fields import ApiError
from edge.models.spec import FOREVER, ModelSpec

log = logging.getLogger("edge.models")
LOADED, LOADING, UNLOADED, UNLOADING, FAILED = "loaded", "loading", "unloaded", "unloading", "failed"
CAPACITY_RETRY_S = 10  # Retry-After of a model_capacity 503: about how long a busy model's requests take to end


class Stack(Protocol):
    """One model's processes and gateway (edge.models.stack.ModelStack; a fake in the fast tests)."""
    gateway: object

    async def start(self) -> None: ...  # returns once the model answers; raises with the reason it cannot

    async def stop(self) -> None: ...  # its requests drained, its processes gone

    def in_flight(self) -> int: ...  # requests accepted and not ended

    def memory(self) -> dict: ...  # {"rss": bytes, "pss": bytes | None} of its processes now


class LoadFailed(Exception):
    """A model's stack could not start: the reason is what its 503 says."""


@dataclass
class Slot:
    """One configured model's place: its state and what the rules above read."""
    spec: ModelSpec
    state: str = UNLOADED
    stack: Stack | None = None
    error: str = ""  # why it failed to load
    cost: dict[str, int] = field(default_factory=dict)  # where -> bytes its plan takes (while loading or loaded)
    keep_alive_s: float = 0.0  # what follows the last request: the model's, or that request's own
    leases: int = 0  # requests between acquire and release
    last_used: float = 0.0  # monotonic
    loaded_at: float | None = None  # wall clock
    expires_at: float | None = None  # wall clock: when the idle timer unloads it
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task | None = None  # its load or unload
    waiters: list = field(default_factory=list)  # heap of (priority, seq, future): requests waiting for its load
    load_started: float = 0.0  # monotonic

    @property
    def busy(self) -> bool:
        return self.leases > 0 or (self.stack is not None and self.stack.in_flight() > 0)


class ModelRegistry:
    """The configured models by name. make_stack(spec) builds a model's stack (nothing started); cost(spec) is its
    plan's bytes per budget (MemoryRefused: it cannot fit at all); budgets: where -> bytes for every model together,
    less `overhead` (what the gateway itself takes); None: no budget is checked."""

    def __init__(self, specs: tuple[ModelSpec, ...], make_stack: Callable[[ModelSpec], Stack],
                 cost: Callable[[ModelSpec], dict[str, int]] | None = None, budgets: dict[str, int] | None = None,
                 load_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = {spec.name: Slot(spec, keep_alive_s=spec.keep_alive_s) for spec in specs}
        self.make_stack, self.cost, self.budgets = make_stack, cost, budgets
        self.load_timeout_s = load_timeout_s
        self.clock = clock
        self.closing = False
        self._seq = itertools.count()
        self.on_change: list[Callable[[str, str], None]] = []  # (name, state) after each change
        self.several = True  # served from [[models]]; False: the single-model config's one, loaded by the app
        self.priorities = None  # edge.models.stack.SharedPriority of the loaded engines, when several

    @classmethod
    def single(cls, spec: ModelSpec, stack: Stack) -> ModelRegistry:
        """The single-model config's one model: loaded (by the app's own start), pinned, never unloaded."""
        registry = cls((spec,), lambda spec: stack)
        slot = registry.slots[spec.name]
        slot.state, slot.stack, slot.loaded_at = LOADED, stack, time.time()
        registry.several = False
        return registry

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def stack(self, name: str) -> Stack | None:
        """The model's stack while it is loaded, else None."""
        slot = self.slots.get(name)
        return slot.stack if slot is not None and slot.state == LOADED else None

    def loaded(self) -> list[Stack]:
        return [s.stack for s in self.slots.values() if s.state == LOADED and s.stack is not None]

    # --- what /v1/models, /api/ps and /api/tags show ---
    def describe(self) -> list[dict]:
        """Every configured model: name, state, GGUF path and size, memory (planned bytes; measured RSS/PSS while
        loaded), loaded_at and expires_at (Unix times or None), keep_alive (seconds, None for forever), pinned,
        requests in flight, and why it failed."""
        return [self._describe(slot) for slot in self.slots.values()]

    def _describe(self, slot: Slot) -> dict:
        path = slot.spec.model or ""
        try:
            size = os.path.getsize(path) if path else 0
        except OSError:
            size = 0
        measured = slot.stack.memory() if slot.stack is not None and slot.state == LOADED else None
        return {"name": slot.spec.name, "state": slot.state, "model": path, "size": size,
                "memory": {"planned": dict(slot.cost), "measured": measured},
                "loaded_at": slot.loaded_at, "expires_at": slot.expires_at,
                "keep_alive": None if slot.keep_alive_s == FOREVER else slot.keep_alive_s,
                "pinned": slot.spec.pinned, "in_flight": slot.stack.in_flight() if slot.stack else 0,
                "error": slot.error or None}

    # --- requests ---
    async def acquire(self, name: str, priority: int = 0, keep_alive_s: float | None = None) -> Stack:
        """The model's stack, loaded first if it is not (waiting at most load_timeout_s, behind the more important
        requests waiting for the same load). Hold it until release(name). ApiError: 503 model_capacity (no memory
        can be freed now), 503 model_failed (its load failed: the reason), 503 model_loading (still loading)."""
        slot = self.slots[name]
        deadline = self.clock() + self.load_timeout_s
        granted = False  # woken by its load's end with the lease taken for it (_wake)
        while not granted and slot.state != LOADED:
            if self.closing:
                raise ApiError(503, "the server is shutting down", error_type="server_error", code="shutting_down",
                               headers={"Retry-After": "5"})
            if slot.state == FAILED:
                raise self._failed_error(slot)
            if slot.state == UNLOADED:
                self._begin_load(slot)
            granted = await self._wait_turn(slot, priority, deadline)
        if not granted:
            slot.leases += 1
        slot.last_used = self.clock()
        self._disarm(slot)
        if keep_alive_s is not None:
            slot.keep_alive_s = keep_alive_s
        return slot.stack

    def release(self, name: str) -> None:
        """A request that acquired the model ended (its answer is out): the idle timer starts once none is left."""
        slot = self.slots[name]
        slot.leases = max(0, slot.leases - 1)
        slot.last_used = self.clock()
        if slot.leases == 0 and slot.state == LOADED:
            self._arm(slot)

    async def _wait_turn(self, slot: Slot, priority: int, deadline: float) -> bool:
        """Until the slot's state changes (its load ends), woken in priority order among its waiters. True: it is
        loaded and this request holds a lease already (taken as it was woken, so that no idle timer runs between
        the load's end and the request's turn)."""
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(slot.waiters, (priority, next(self._seq), future))
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - self.clock()))
        except asyncio.CancelledError:  # the client went away: a lease taken for it goes back
            if future.done() and not future.cancelled() and future.result():
                self.release(slot.spec.name)
            raise
        except TimeoutError:
            raise ApiError(503, f"the model {slot.spec.name!r} is still loading after {self.load_timeout_s:.0f} s "
                                f"(model_load_timeout_s); retry shortly", error_type="server_error",
                           code="model_loading", headers={"Retry-After": "5"}) from None

    def _wake(self, slot: Slot) -> None:
        """Every waiter, most important first (asyncio resumes them in the order their futures are set)."""
        while slot.waiters:
            _, _, future = heapq.heappop(slot.waiters)
            if not future.done():
                granted = slot.state == LOADED
                slot.leases += granted
                future.set_result(granted)

    # --- loading ---
    async def load(self, name: str) -> dict:
        """An operator's load (POST /v1/models/{id}/load): a failed model is tried again. Returns its description
        once loaded; ApiError as acquire's."""
        slot = self.slots[name]
        if slot.state == FAILED:
            slot.state, slot.error = UNLOADED, ""
        await self.acquire(name, priority=-(2**31))
        self.release(name)
        return self._describe(slot)

    async def start(self) -> None:
        """Load the pinned models (the single-model config's one is): all at once, each within the budget."""
        pinned = [name for name, slot in self.slots.items() if slot.spec.pinned]
        results = await asyncio.gather(*(self.load(name) for name in pinned), return_exceptions=True)
        for name, result in zip(pinned, results, strict=True):
            if isinstance(result, BaseException):
                log.error("pinned model %s did not load: %s", name, result)

    def _begin_load(self, slot: Slot) -> None:
        """Plan the model's memory, choose what must go for it (marked unloading now, so that no other load counts
        on it), and start the load task. Raises ApiError 503 model_capacity when it cannot fit now."""
        try:
            cost = self.cost(slot.spec) if self.cost is not None else {}
        except (ValueError, OSError) as err:  # a bad or missing GGUF, an unsupported family; MemoryRefused: it
            # cannot fit even alone
            self._set(slot, FAILED, error=str(err))
            raise self._failed_error(slot) from None
        victims = self._victims(slot, cost)
        for victim in victims:
            self._begin_unload(victim, "evicted (least recently used) for " + slot.spec.name)
        # those unloading already (idle past keep_alive, an operator's) are waited for too: their memory is counted free
        going = [s.task for s in self.slots.values() if s is not slot and s.state == UNLOADING]
        slot.cost, slot.load_started, slot.error = cost, self.clock(), ""
        self._set(slot, LOADING)
        slot.task = spawn(self._load(slot, going), f"loading {slot.spec.name}", log)

    def _victims(self, slot: Slot, cost: dict[str, int]) -> list[Slot]:
        """The least recently used idle models that must be unloaded for `cost` to fit; ApiError when even all of
        them would not make room."""
        if self.budgets is None:
            return []
        held = [s for s in self.slots.values() if s is not slot and s.state in (LOADED, LOADING)]
        idle = sorted((s for s in held if s.state == LOADED and not s.spec.pinned and not s.busy),
                      key=lambda s: s.last_used)
        victims: list[Slot] = []
        while not self._fits(cost, [s for s in held if s not in victims]):
            if not idle:
                raise self._capacity_error(slot, cost, held)
            victims.append(idle.pop(0))
        return victims

    def _fits(self, cost: dict[str, int], held: list[Slot]) -> bool:
        return all(cost.get(where, 0) + sum(s.cost.get(where, 0) for s in held) <= budget
                   for where, budget in self.budgets.items())

    async def _load(self, slot: Slot, evictions: list[asyncio.Task | None]) -> None:
        began = self.clock()
        try:
            for task in evictions:  # their memory first
                if task is not None:
                    await asyncio.shield(task)
            slot.stack = self.make_stack(slot.spec)
            await asyncio.wait_for(slot.stack.start(), self.load_timeout_s)
        except Exception as err:  # noqa: BLE001 - any failure is this model's alone: its reason is kept and shown
            reason = (f"it did not load within {self.load_timeout_s:.0f} s (model_load_timeout_s)"
                      if isinstance(err, TimeoutError) else str(err) or type(err).__name__)
            log.error("model %s failed to load: %s", slot.spec.name, reason)
            stack, slot.stack = slot.stack, None
            if stack is not None:
                await _stopped(stack, slot.spec.name)
            slot.cost = {}
            self._set(slot, FAILED, error=reason)
            return
        slot.loaded_at, slot.last_used = time.time(), self.clock()
        log.info("model %s loaded in %.1f s", slot.spec.name, self.clock() - began)
        self._set(slot, LOADED)  # its waiters hold their leases now
        if slot.leases == 0:  # loaded by an operator, or its requesters gave up
            self._arm(slot)

    # --- unloading ---
    async def unload(self, name: str, reason: str = "unloaded by an operator") -> dict:
        """An operator's unload (POST /v1/models/{id}/unload): pinned ones too, never one with requests in flight
        (409 model_busy). Returns its description once unloaded."""
        slot = self.slots[name]
        if slot.state == LOADING and slot.task is not None:
            await asyncio.shield(slot.task)
        if slot.busy:
            raise ApiError(409, f"the model {name!r} has {max(slot.leases, slot.stack.in_flight())} requests in "
                                f"flight; unload it once they end", "model", "model_busy",
                           headers={"Retry-After": "5"})
        if slot.state == LOADED:
            self._begin_unload(slot, reason)
        if slot.state == UNLOADING and slot.task is not None:
            await asyncio.shield(slot.task)
        return self._describe(slot)

    def _begin_unload(self, slot: Slot, reason: str) -> None:
        self._disarm(slot)
        self._set(slot, UNLOADING)
        slot.task = spawn(self._unload(slot, reason), f"unloading {slot.spec.name}", log)

    async def _unload(self, slot: Slot, reason: str) -> None:
        stack, slot.stack = slot.stack, None
        log.info("model %s: %s", slot.spec.name, reason)
        if stack is not None:
            await _stopped(stack, slot.spec.name)
        slot.cost, slot.loaded_at, slot.expires_at = {}, None, None
        slot.keep_alive_s = slot.spec.keep_alive_s  # a request's keep_alive lasted until this unload
        self._set(slot, UNLOADED)

    def _arm(self, slot: Slot) -> None:
        """The idle timer: keep_alive from now (0: unload now; FOREVER and pinned: never)."""
        self._disarm(slot)
        if slot.spec.pinned or slot.keep_alive_s == FOREVER or self.closing:
            return
        if slot.keep_alive_s <= 0:
            self._begin_unload(slot, "unloaded after its answer (keep_alive 0)")
            return
        slot.expires_at = time.time() + slot.keep_alive_s
        slot.timer = asyncio.get_running_loop().call_later(slot.keep_alive_s, self._expire, slot)

    def _disarm(self, slot: Slot) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
        slot.timer, slot.expires_at = None, None

    def _expire(self, slot: Slot) -> None:
        slot.timer = None
        if slot.state == LOADED and not slot.busy:
            self._begin_unload(slot, f"idle for {slot.keep_alive_s:g} s (keep_alive)")

    async def close(self) -> None:
        """Every loaded model's stack stopped (at the server's shutdown, after the drain)."""
        self.closing = True
        for slot in self.slots.values():
            self._disarm(slot)
            self._wake(slot)
        tasks = [s.task for s in self.slots.values() if s.task is not None and not s.task.done()]
        await asyncio.gather(*tasks, return_exceptions=True)
        for slot in self.slots.values():
            if slot.state == LOADED:
                self._begin_unload(slot, "the server is stopping")
        await asyncio.gather(*(s.task for s in self.slots.values() if s.task is not None), return_exceptions=True)

    # --- state and errors ---
    def _set(self, slot: Slot, state: str, error: str = "") -> None:
        slot.state = state
        if error:
            slot.error = error
        if state != LOADING:
            self._wake(slot)
        for listener in self.on_change:
            try:
                listener(slot.spec.name, state)
            except Exception:  # a listener's fault must not stop a load
                log.exception("model state listener failed")

    @staticmethod
    def _failed_error(slot: Slot) -> ApiError:
        return ApiError(503, f"the model {slot.spec.name!r} failed to load: {slot.error} (POST "
                             f"/v1/models/{slot.spec.name}/load to try again)", "model", "model_failed",
                        error_type="server_error")

    def _capacity_error(self, slot: Slot, cost: dict[str, int], held: list[Slot]) -> ApiError:
        kept = ", ".join(f"{s.spec.name} ({'pinned' if s.spec.pinned else s.state if s.state != LOADED else 'busy'})"
                         for s in held)
        need = ", ".join(f"{where} {cost.get(where, 0) >> 20} MiB of {budget >> 20}" for where, budget in
                         self.budgets.items())
        return ApiError(503, f"no memory for the model {slot.spec.name!r} now ({need}): the models holding it "
                             f"cannot be unloaded: {kept or 'none'}; retry once their requests end",
                        "model", "model_capacity", error_type="server_error",
                        headers={"Retry-After": str(CAPACITY_RETRY_S)})


async def _stopped(stack: Stack, name: str) -> None:
    try:
        await stack.stop()
    except Exception:  # its processes are the supervisor's; a failed stop must not wedge the registry
        log.exception("stopping model %s failed", name)
