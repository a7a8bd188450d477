"""Several decode engines behind the one interface the gateway knows (EngineClient's): one per GPU, across nodes.

Each prefill worker hands its KV to one engine (its `--engine`), so the gateway's choice of engine for a request
is its choice of worker: when a job is dispatched, idle workers are ranked by the load of their engine (`load`:
requests waiting or running there, then KV use), and the least loaded one takes it. The rest fans out: the best priority in prefill goes to
every engine, an abort to the engine of the request's worker, and the gateway sees the sum of their stats.
"""

from __future__ import annotations

import asyncio
import dataclasses

from contracts.events import EngineStats
from edge.engine_client import EngineClient
from edge.lifecycle import InFlightRegistry, RequestStatus

ACTIVE = (RequestStatus.PREFILLING, RequestStatus.HANDED_OFF, RequestStatus.DECODING)


class EngineGroup:
    def __init__(self, clients: dict[str, EngineClient], worker_engine: dict[str, str],
                 registry: InFlightRegistry) -> None:
        self.clients = clients
        self.worker_engine = worker_engine  # prefill worker name -> the engine it hands off to
        self.registry = registry
        self.yield_to: int | None = None
        for name, client in clients.items():
            client.owns = lambda request, name=name: self.engine_of(request.worker) == name

    def engine_of(self, worker: str) -> str:
        return self.worker_engine.get(worker, "")

    def load(self, engine: str) -> float:
        """Requests in flight there (in prefill for it, waiting or running in it), plus the fraction of its KV blocks
        in use; an engine that is down ranks last. The count is the gateway's own: it is the engines' only source of
        requests, and the engines' reports lag by up to a stats interval (a request that has just finished would
        still count, a burst just sent would not yet)."""
        client = self.clients[engine]
        if client.state != "ready":
            return float("inf")
        sent = sum(1 for r in self.registry.requests.values() if r.status in ACTIVE and self.engine_of(r.worker) == engine)
        stats = client.stats
        kv = stats.kv_blocks_used / stats.kv_blocks_total if stats is not None and stats.kv_blocks_total else 0.0
        return sent + kv

    def rank_worker(self, worker: str) -> float:
        engine = self.engine_of(worker)
        return self.load(engine) if engine in self.clients else float("inf")

    # --- EngineClient's interface, for the gateway ----------------------------------------------------------
    @property
    def state(self) -> str:
        states = [c.state for c in self.clients.values()]
        return "ready" if "ready" in states else "connecting" if "connecting" in states else states[0]

    @property
    def last_error(self) -> str | None:
        errors = [f"{name}: {c.last_error}" for name, c in self.clients.items() if c.last_error]
        return "; ".join(errors) or None

    @property
    def stats(self) -> EngineStats | None:
        """The sum over connected engines; a request's context is capped by the smallest one's pool."""
        reports = [c.stats for c in self.clients.values() if c.stats is not None]
        if not reports:
            return None
        summed = {f.name: sum(getattr(s, f.name) for s in reports) for f in dataclasses.fields(EngineStats)
                  if f.type in (int, float, "int", "float")}
        summed["kv_capacity_tokens"] = min(s.kv_capacity_tokens for s in reports)
        summed["last_step_ms"] = max(s.last_step_ms for s in reports)
        return dataclasses.replace(reports[0], **summed)

    @property
    def closing(self) -> bool:
        return all(c.closing for c in self.clients.values())

    @closing.setter
    def closing(self, value: bool) -> None:
        for client in self.clients.values():
            client.closing = value

    async def run(self) -> None:
        await asyncio.gather(*(c.run() for c in self.clients.values()))

    async def abort(self, request_id: str) -> None:
        request = self.registry.get(request_id)
        engine = self.engine_of(request.worker) if request is not None else ""
        targets = [self.clients[engine]] if engine in self.clients else list(self.clients.values())
        for client in targets:
            await client.abort(request_id)

    def prefill_priority_changed(self, priority: int | None) -> None:
        self.yield_to = priority
        for client in self.clients.values():
            client.prefill_priority_changed(priority)
