"""Several decode engines behind the one interface the gateway knows (EngineClient's): one per GPU, across nodes.

The engine is chosen per request, as a prefill worker takes its job (`choose`), and travels in the job
(PrefillJob.engine): any worker hands off to any engine. The choice, in order:
- an engine that is not ready is never chosen (while none is, jobs wait in the queue);
- prefix affinity: the engine that last took a prompt with the same leading text (edge.core.affinity), unless its load
  exceeds the least loaded engine's by more than the larger of AFFINITY_MARGIN requests and AFFINITY_SHARE of the
  least loaded engine's load (docs/cluster.md: how the rule behaves);
- otherwise the least loaded (`load`: requests the gateway has sent there and not seen end, then KV use).
The rest fans out: the best priority in prefill goes to every engine, an abort to the request's engine, and the
gateway sees the sum of their stats.
"""

from __future__ import annotations

import asyncio
import dataclasses

from contracts.events import EngineStats
from edge.core.affinity import PrefixAffinity
from edge.core.engine_client import EngineClient
from edge.core.lifecycle import InFlightRegistry, RequestStatus

ACTIVE = (RequestStatus.PREFILLING, RequestStatus.HANDED_OFF, RequestStatus.DECODING)
# How much busier than the least loaded engine the engine holding a prompt's prefix may be and still get it: a
# prefix hit saves that engine the shared blocks' pool memory and their import, and one more sequence in a batched
# decode step costs little (a step at batch 32 takes ~3x batch 1's time, not 32x); past the margin, balance wins.
AFFINITY_MARGIN = 2.0
AFFINITY_SHARE = 0.25


class EngineGroup:
    def __init__(self, clients: dict[str, EngineClient], registry: InFlightRegistry,
                 affinity: PrefixAffinity | None = None) -> None:
        self.clients = clients
        self.registry = registry
        self.affinity = affinity or PrefixAffinity()
        self.yield_to: int | None = None
        self.speculation = True
        self.num_affinity_hits = 0  # choices where a remembered prefix beat the least loaded engine
        for client in clients.values():  # each owns only the requests chosen for it (EngineClient.owns)
            client.sole = False

    def num_requests(self, engine: str) -> int:
        """Requests sent to it (in prefill for it, handed off, decoding) that have not ended."""
        return sum(1 for r in self.registry.requests.values() if r.status in ACTIVE and r.engine == engine)

    def load(self, engine: str) -> float:
        """Requests in flight there, plus the fraction of its KV blocks in use; an engine that is not ready ranks
        last. The count is the gateway's own: it is the engines' only source of requests, and the engines' reports
        lag by up to a stats interval (a request that has just finished would still count, a burst just sent would
        not yet)."""
        client = self.clients[engine]
        if client.state != "ready":
            return float("inf")
        stats = client.stats
        kv = stats.kv_blocks_used / stats.kv_blocks_total if stats is not None and stats.kv_blocks_total else 0.0
        return self.num_requests(engine) + kv

    def pick(self, key: bytes | None) -> str | None:
        """The engine for a prompt with this prefix key (module docstring); None while no engine is ready."""
        loads = {name: self.load(name) for name in self.clients}
        least = min(loads, key=loads.__getitem__)
        if loads[least] == float("inf"):
            return None
        affine = self.affinity.get(key)
        if affine in loads and loads[affine] <= loads[least] + max(AFFINITY_MARGIN, AFFINITY_SHARE * loads[least]):
            self.num_affinity_hits += affine != least
            return affine
        return least

    def choose(self, request_id: str) -> str | None:
        """As a worker takes the request: its engine's address for the job, or None to keep it queued."""
        request = self.registry.get(request_id)
        name = self.pick(request.prefix_key if request is not None else None)
        if name is None:
            return None
        if request is not None:
            request.engine = name
            self.affinity.remember(request.prefix_key, name)
        return self.clients[name].address

    # --- EngineLink (edge.core.engine_link), for the gateway -------------------------------------------------
    def links(self) -> dict[str, EngineClient]:
        return dict(self.clients)

    def describe(self) -> dict:
        """/health's table: each engine's state and address, what the gateway sent it, what it last reported."""
        engines = {}
        for name, client in self.clients.items():
            stats = client.stats
            engines[name] = {"state": client.state, "address": client.address, "requests": self.num_requests(name),
                             "running": stats.num_running if stats else None,
                             "waiting": stats.num_waiting if stats else None,
                             "kv_usage": round(stats.kv_blocks_used / stats.kv_blocks_total, 4)
                             if stats and stats.kv_blocks_total else None}
        return engines

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
        # the TPOT check (edge/core/slo.py predict_tpot): a request joins one engine's batch, so that of the engine with
        # the fewest sequences with objectives, and its step times
        quietest = min(reports, key=lambda s: s.tpot_sequences)
        summed["tpot_sequences"] = quietest.tpot_sequences
        return dataclasses.replace(reports[0], **summed, step_ms=quietest.step_ms)

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
        engine = request.engine if request is not None else ""
        targets = [self.clients[engine]] if engine in self.clients else list(self.clients.values())
        for client in targets:
            await client.abort(request_id)

    def speculation_changed(self, enabled: bool) -> None:
        self.speculation = enabled
        for client in self.clients.values():
            client.speculation_changed(enabled)

    def prefill_priority_changed(self, priority: int | None) -> None:
        self.yield_to = priority
        for client in self.clients.values():
            client.prefill_priority_changed(priority)

    def prefill_backlog_changed(self, backlog: bool) -> None:
        for client in self.clients.values():
            client.prefill_backlog_changed(backlog)
