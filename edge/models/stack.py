"""One model's stack (issue 45): its gateway, prefill pool, engine connection, supervisor and the processes it runs,
and its run dir: what `edge serve` runs for a single model, started and stopped on the registry's demand
(edge.models.registry). The start and stop are the single-model app's own steps (edge.launch.local)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable

from contracts.events import FinishReason
from contracts.model_kind import model_kind
from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from edge.launch import local
from edge.launch.launcher import Supervisor, ready_probe
from edge.models.registry import LoadFailed
from edge.observe.process_memory import process_memory
from policies.enforcer import PolicyEnforcer

log = logging.getLogger("edge.models.stack")
READY_POLL_S = 0.1  # how often a starting stack looks whether its gateway is ready (no event says it)


class ModelStack:
    """A model served by its own processes; `config` is its own (edge.config.model_config, with its memory plan's
    decisions). Built without starting anything; start() launches and connects, stop() drains and ends them."""

    def __init__(self, config: ServeConfig, enforcer: PolicyEnforcer, metrics: Metrics, grammar_checks,
                 forward: Callable, priorities: SharedPriority | None = None) -> None:
        self.config, self.name = config, config.model_name
        self.model_path = config.model
        kind = model_kind(self.model_path) if os.path.isfile(self.model_path) else None
        self.embedding_only = kind is not None and kind.embedding
        self.grammar_checks = grammar_checks
        self.run_dir = local.make_run_dir(config)
        self.engine_address, self.worker_addresses = local.resolve_addresses(config, self.run_dir)
        self.supervisor = Supervisor()
        gateway: Gateway | None = None
        requests = InFlightRegistry()
        self.pool, self.engine = local.local_components(
            config, requests, self.engine_address, self.worker_addresses, self.supervisor,
            lambda ask, client: gateway.recompute(ask, client))
        self.gateway = gateway = Gateway(config, self.name, self.pool, self.engine, requests, metrics, enforcer)
        gateway.embedding_only = self.embedding_only
        gateway.observers.append(forward)  # the app's observers: quotas, audit, traces, the status board
        self.priorities = priorities
        if priorities is not None:  # the best priority waiting across every model's prefill, not this pool's own
            self.pool.on_best_priority = priorities.reporter(self.name)
            self.pool.choose_engine = self._held_back(self.pool.choose_engine)
        self.supervisor.is_ready = ready_probe(gateway)
        self.supervisor.stop_timeout_s = max(1.0, config.limits.shutdown_grace_s)
        self._tasks: list[asyncio.Task] = []

    def _held_back(self, choose: Callable[[str], str | None]) -> Callable[[str], str | None]:
        """The pool's engine choice for a prompt about to go to a worker, None (the pool keeps it queued and tries
        again at the worker's next message, a heartbeat within a second) while another model has a more important
        prompt waiting or prefilling: the cores go to it, as they would within one pool."""
        def choose_engine(request_id: str) -> str | None:
            request = self.gateway.registry.get(request_id)
            if request is not None and self.priorities.outranked(self.name, request.priority):
                return None
            return choose(request_id)
        return choose_engine

    async def start(self) -> None:
        """Launch the processes and connect; returns once the model answers. LoadFailed: a process failed its
        start for good (a GGUF llama.cpp aborts on), with its last words."""
        self._tasks = [local.start_processes(self.supervisor, self.config, self.model_path, self.engine_address,
                                              self.worker_addresses, self.run_dir, self.embedding_only,
                                              self.grammar_checks),
                       *local.connection_tasks(self.gateway, announce=False)]
        if self.priorities is not None and not self.embedding_only:
            self.priorities.attach(self.name, self.engine, self.pool)
        while not self.gateway.ready:
            if self.supervisor.start_failure:
                raise LoadFailed(self.supervisor.start_failure)
            await asyncio.sleep(READY_POLL_S)

    async def stop(self) -> None:
        """Its requests get the shutdown grace to end (then an abort), its connections close, its processes exit
        and its run dir goes."""
        gateway, requests = self.gateway, self.gateway.registry
        gateway.shutting_down = True
        if self.priorities is not None:
            self.priorities.detach(self.name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.limits.shutdown_grace_s
        while requests.requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(requests.requests):
            requests.deliver_ending(request_id, FinishReason.ABORT)
        self.engine.closing = self.pool.closing = True
        for task in self._tasks[1:]:
            task.cancel()
        await self.supervisor.shutdown()
        if self._tasks:
            self._tasks[0].cancel()
        if not self.config.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def in_flight(self) -> int:
        return len(self.gateway.registry.requests)

    def pids(self) -> dict[str, int]:
        return {f"{self.name}/{name}": child.process.pid for name, child in self.supervisor.children.items()
                if child.process is not None}

    def memory(self) -> dict:
        """What its processes hold now: {"rss", "pss"} in bytes (pss None where the system has none)."""
        return process_memory(self.pids(), None)["total"]


class ServedStack:
    """The single-model config's one stack, started and stopped by the app itself (edge.app's cleanup contexts, as
    before several models were served): the registry sees it loaded and pinned."""

    def __init__(self, gateway: Gateway, supervisor: Supervisor | None) -> None:
        self.gateway, self.supervisor = gateway, supervisor

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def in_flight(self) -> int:
        return len(self.gateway.registry.requests)

    def memory(self) -> dict | None:
        if self.supervisor is None:
            return None
        pids = {name: child.process.pid for name, child in self.supervisor.children.items()
                if child.process is not None}
        return process_memory(pids, None)["total"]


class SharedPriority:
    """Every loaded engine is told the best priority waiting for prefill across all models (lower is more
    important), so that model A's low-priority decode yields the CPU to model B's more important prompt as it does
    to its own (decode_gpu/core/priority_gate.py)."""

    def __init__(self) -> None:
        self.best: dict[str, int | None] = {}  # model -> its pool's best waiting priority
        self.engines: dict[str, object] = {}  # model -> its EngineClient
        self.pools: dict[str, object] = {}  # model -> its PrefillPool (a model with no worker ready holds none back)
        self.told: int | None = None

    def reporter(self, name: str) -> Callable[[int | None], None]:
        def report(priority: int | None) -> None:
            self.best[name] = priority
            self._tell()
        return report

    def attach(self, name: str, engine, pool=None) -> None:
        self.engines[name] = engine
        if pool is not None:
            self.pools[name] = pool
        engine.prefill_priority_changed(self.overall)

    def detach(self, name: str) -> None:
        self.engines.pop(name, None)
        self.pools.pop(name, None)
        self.best.pop(name, None)
        self._tell()

    def outranked(self, name: str, priority: int) -> bool:
        """Whether another model with a worker ready has a prompt more important than `priority` waiting for or in
        prefill (a model whose workers are all down holds no other back)."""
        return any(p is not None and p < priority and self._serving(other) for other, p in self.best.items()
                   if other != name)

    def _serving(self, name: str) -> bool:
        pool = self.pools.get(name)
        return pool is None or pool.num_ready > 0

    @property
    def overall(self) -> int | None:
        waiting = [p for p in self.best.values() if p is not None]
        return min(waiting) if waiting else None

    def _tell(self) -> None:
        overall = self.overall
        if overall == self.told:
            return
        self.told = overall
        for engine in self.engines.values():
            engine.prefill_priority_changed(overall)

