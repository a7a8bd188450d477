"""The gateway's prefill queue (ordered by priority, then arrival) and its connections to prefill workers.

A worker gets one job at a time; when it answers, the best waiting job goes to it. When every worker
is busy with lower-priority prompts, a higher-priority arrival preempts the worst of them: the worker
stops at once (within a llama.cpp chunk) and that job goes back to the queue in its old place, to resume
from the worker's prompt cache. A worker
whose connection drops fails its current job with a clear error and is reconnected when it comes back.
Whenever the best priority among queued and prefilling prompts changes, `on_best_priority` hears it (the
gateway passes it on to the engine, whose lower-priority decode then yields the CPU on a CPU-only box).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from dataclasses import dataclass

from edge.lifecycle import InFlightRegistry, RequestStatus
from edge.protocol import (CancelPrefill, Hello, PrefillDone, PrefillFailed, PrefillJob, WorkerStatus,
                           connect_when_listening, read_message, send_message)

log = logging.getLogger("edge.prefill_pool")


class QueueFullError(RuntimeError):
    """The prefill queue is at its limit."""


@dataclass
class WorkerClient:
    name: str
    address: str
    writer: asyncio.StreamWriter | None = None
    state: str = "connecting"  # connecting | ready | down
    current: str | None = None  # request id being prefilled
    current_entry: tuple | None = None  # its (priority, arrival, job) queue entry, to requeue it if preempted
    preempting: bool = False  # a cancel was sent to make room for a higher-priority job
    info: WorkerStatus | None = None


class PrefillPool:
    def __init__(self, addresses: dict[str, str], registry: InFlightRegistry, queue_limit: int) -> None:
        self.workers = {name: WorkerClient(name, address) for name, address in addresses.items()}
        self.registry = registry
        self.queue_limit = queue_limit
        self.queue: list[tuple[int, int, PrefillJob]] = []
        self.counter = itertools.count()
        self.tokens_per_s = 0.0
        self.closing = False  # set at shutdown: dropped connections are then expected
        self.on_best_priority = lambda priority: None  # called with int | None on every change
        self.best_priority: int | None = None

    @property
    def queue_length(self) -> int:
        return len(self.queue)

    @property
    def num_ready(self) -> int:
        return sum(1 for w in self.workers.values() if w.state == "ready")

    def submit(self, job: PrefillJob) -> None:
        if len(self.queue) >= self.queue_limit:
            raise QueueFullError(f"the prefill queue is full ({self.queue_limit} prompts waiting)")
        heapq.heappush(self.queue, (job.priority, next(self.counter), job))
        self._dispatch()
        if self.queue and self.queue[0][2] is job:
            self._preempt_for(job)
        self._announce()

    def _preempt_for(self, job: PrefillJob) -> None:
        """Stop the lowest-priority prefill in progress if it ranks strictly below this job."""
        busy = [w for w in self.workers.values()
                if w.state == "ready" and w.current_entry is not None and not w.preempting]
        if not busy:
            return
        victim = max(busy, key=lambda w: w.current_entry[:2])
        if victim.current_entry[0] <= job.priority:
            return
        victim.preempting = True
        log.info("preempting prefill of %s (priority %d) on %s for %s (priority %d)", victim.current,
                 victim.current_entry[0], victim.name, job.request_id, job.priority)
        asyncio.ensure_future(self._send(victim, CancelPrefill(victim.current)))

    async def cancel(self, request_id: str) -> None:
        before = len(self.queue)
        self.queue = [item for item in self.queue if item[2].request_id != request_id]
        if len(self.queue) != before:
            heapq.heapify(self.queue)
            self._announce()
            return
        for worker in self.workers.values():
            if worker.current == request_id and worker.writer is not None:
                try:
                    await send_message(worker.writer, CancelPrefill(request_id))
                except ConnectionError:
                    pass

    async def run(self) -> None:
        await asyncio.gather(*(self._maintain(w) for w in self.workers.values()))

    async def _maintain(self, worker: WorkerClient) -> None:
        while True:
            reader, writer = await connect_when_listening(worker.address, Hello("gateway"))
            worker.writer = writer
            try:
                await self._serve(worker, reader)
            finally:
                self._lost(worker)
                writer.close()
            await asyncio.sleep(0.2)

    async def _serve(self, worker: WorkerClient, reader: asyncio.StreamReader) -> None:
        while (message := await read_message(reader)) is not None:
            if isinstance(message, WorkerStatus):
                worker.info, worker.state = message, "ready"
                log.info("prefill worker %s ready (%s, KV %s)", worker.name, worker.address, message.kv_type)
            elif isinstance(message, (PrefillDone, PrefillFailed)):
                self._finished(worker, message)
            self._dispatch()
            self._announce()

    def _finished(self, worker: WorkerClient, message: PrefillDone | PrefillFailed) -> None:
        entry, preempted = worker.current_entry, worker.preempting
        if worker.current == message.request_id:
            worker.current, worker.current_entry, worker.preempting = None, None, False
        if isinstance(message, PrefillFailed) and message.kind == "cancelled" and preempted and entry:
            heapq.heappush(self.queue, entry)  # preempted, not failed: back in its old place
            return
        if isinstance(message, PrefillDone):
            self._record(message)
        self.registry.deliver(message.request_id, message)

    def _lost(self, worker: WorkerClient) -> None:
        if worker.state != "down" and not self.closing:
            log.error("lost prefill worker %s", worker.name)
        worker.state, worker.writer = "down", None
        if worker.current is not None:
            self.registry.deliver(worker.current, PrefillFailed(
                worker.current, "worker_died", f"prefill worker {worker.name} died while prefilling this request"))
            worker.current, worker.current_entry, worker.preempting = None, None, False
        self._announce()

    def _announce(self) -> None:
        """Tell the listener the best priority among prompts queued or prefilling, when it changes."""
        ranks = [entry[0] for entry in self.queue]
        ranks += [w.current_entry[0] for w in self.workers.values() if w.current_entry is not None]
        best = min(ranks, default=None)
        if best != self.best_priority:
            self.best_priority = best
            self.on_best_priority(best)

    def _record(self, done: PrefillDone) -> None:
        if done.prefill_ms > 0:
            rate = done.num_prompt_tokens / (done.prefill_ms / 1e3)
            self.tokens_per_s = rate if self.tokens_per_s == 0 else 0.7 * self.tokens_per_s + 0.3 * rate

    def _dispatch(self) -> None:
        for worker in self.workers.values():
            if worker.state != "ready" or worker.current is not None:
                continue
            entry = self._next_live_entry()
            if entry is None:
                return
            job = entry[2]
            worker.current, worker.current_entry = job.request_id, entry
            request = self.registry.get(job.request_id)
            request.advance(RequestStatus.PREFILLING)
            request.prefill_started_at = time.perf_counter()
            request.worker = worker.name
            asyncio.ensure_future(self._send(worker, job))

    def _next_live_entry(self) -> tuple | None:
        while self.queue:
            entry = heapq.heappop(self.queue)
            request = self.registry.get(entry[2].request_id)
            if request is not None and not request.status.terminal:
                return entry
        return None

    async def _send(self, worker: WorkerClient, message) -> None:
        try:
            await send_message(worker.writer, message)
        except (ConnectionError, AttributeError):
            self._lost(worker)


