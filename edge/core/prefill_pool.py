"""The gateway's prefill queue (ordered by priority, then TTFT deadline, earliest first, then arrival) and its
connections to prefill workers.

A worker gets one job at a time; when it answers, the best waiting job goes to it. When every worker
is busy with lower-priority prompts, a higher-priority arrival preempts the worst of them: the worker
stops at once (within a llama.cpp graph node, through its abort callback) and that job goes back to the queue
in its old place. A job goes to the worker that last prefilled a prompt beginning like it (edge.core.affinity's
key: a conversation's turns) when that worker is free too, since its prompt cache holds that conversation and the
answer's KV the engine returned to it; otherwise to any free worker, which prefills it anew (less what its own
cache holds): the queue never waits for a busy worker. Whenever the best
priority among queued and prefilling prompts changes, `on_best_priority` hears it (the gateway passes it on to
the engine, whose lower-priority decode then yields the CPU on a CPU-only box); `on_backlog` hears whether
prompts wait for a busy worker (an engine decoding on the same cores may then pace its steps,
`cpu_decode_pace_ms`).

Nothing a worker does can stall the queue: a job is encoded when it is submitted (a value that cannot
travel is refused then, for that request alone); a worker whose connection drops or sends a bad frame
fails its current job with a clear error and is reconnected; a worker silent for longer than the heartbeat
timeout (frozen, stuck in a call) is declared stuck, its job goes back to the queue when the supervisor
can kill it (or fails when it cannot), and it is reconnected once it is back.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import msgspec

from contracts.framing import PeerRefusedError, ProtocolError, connect_when_listening, pack, read_message
from contracts.messages import (
    CancelPrefill,
    EmbedDone,
    ForgetSalt,
    Heartbeat,
    PrefillDone,
    PrefillFailed,
    PrefillJob,
    PromptLogprobs,
    SaltForgotten,
    WorkerStatus,
)
from contracts.reconnect import Streams, stay_connected
from contracts.tasks import spawn
from edge.core.affinity import PrefixAffinity
from edge.core.lifecycle import InFlightRegistry, RequestStatus

log = logging.getLogger("edge.core.prefill_pool")
HEARTBEAT_TIMEOUT_S = 5.0  # workers send a heartbeat every second, busy or not


class QueueFullError(RuntimeError):
    """The prefill queue is at its limit."""


class UnsendableJobError(ValueError):
    """A job holds a value that cannot be encoded for the wire (the gateway's validation missed it)."""


@dataclass(order=True, frozen=True)
class Entry:
    priority: int
    deadline: float  # the job's TTFT deadline (PrefillJob.deadline), inf without one: earliest first within a priority
    arrival: int
    job: PrefillJob = None  # type: ignore[assignment]  (never compared: arrival is unique)
    frame: bytes = b""  # the job, encoded once at submit


@dataclass
class WorkerClient:
    name: str
    address: str
    writer: asyncio.StreamWriter | None = None
    state: str = "connecting"  # connecting | ready | down | stuck | refused
    current: Entry | None = None  # the job being prefilled
    preempting: bool = False  # a cancel was sent to make room for a higher-priority job
    info: WorkerStatus | None = None
    last_error: str | None = None
    stuck_count: int = 0
    engine_connected: bool = True  # as the worker last said: while False it gets no jobs (they would only fail)
    cache_tiers: tuple = ()  # its prompt cache's tiers (CacheTier), as its last heartbeat said

    @property
    def current_id(self) -> str | None:
        return self.current.job.request_id if self.current is not None else None


class PrefillPool:
    def __init__(self, addresses: dict[str, str], registry: InFlightRegistry, queue_limit: int,
                 secret: bytes = b"", heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, *,
                 on_best_priority: Callable[[int | None], None] = lambda priority: None,
                 on_backlog: Callable[[bool], None] = lambda backlog: None,
                 on_stuck: Callable[[str], bool] = lambda name: False,
                 choose_engine: Callable[[str], str | None] = lambda request_id: "",
                 resolve: Callable[[str], Awaitable[str]] | None = None,
                 connect_timeout_s: float | None = None) -> None:
        self.workers = {name: WorkerClient(name, address) for name, address in addresses.items()}
        self.registry = registry
        self.queue_limit = queue_limit
        self.secret = secret
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.queue: list[Entry] = []
        self.counter = itertools.count()
        self.tokens_per_s = 0.0
        self.closing = False  # set at shutdown: dropped connections are then expected
        self.on_best_priority = on_best_priority  # called with int | None on every change
        self.on_backlog = on_backlog  # called with a bool on every change (see _announce)
        self.backlog = False
        self.on_stuck = on_stuck  # kill a stuck worker (the supervisor); True if it will be restarted
        self.best_priority: int | None = None
        # Ray mode (edge/launch/ray_*): where a worker listens now, asked before each connection, since a restarted
        # actor may be on another node; an address that does not answer within connect_timeout_s is asked for again
        self.resolve = resolve  # async (name) -> address
        self.connect_timeout_s = connect_timeout_s
        # the decode engine a job hands off to, chosen as a worker takes it (the engines' load then is what counts):
        # its address for the job ("": the worker's own), or None to keep the job queued (no engine can take it)
        self.choose_engine = choose_engine
        # prompt prefix -> the worker that prefilled it last: a conversation's next turn goes back to it when free
        self.affinity = PrefixAffinity()
        self._forgetting: dict[tuple[str, str], asyncio.Future] = {}  # (worker, salt) -> its SaltForgotten

    @property
    def queue_length(self) -> int:
        return len(self.queue)

    @property
    def num_ready(self) -> int:
        return sum(1 for w in self.workers.values() if w.state == "ready")

    @property
    def embedding(self) -> WorkerStatus | None:
        """A ready worker's status: its embeddings' size and pooling (every worker loads the same model)."""
        return next((w.info for w in self.workers.values() if w.info is not None), None)

    @property
    def vocab_size(self) -> int | None:
        sizes = [w.info.vocab_size for w in self.workers.values() if w.info is not None]
        return min(sizes) if sizes else None

    def submit(self, job: PrefillJob) -> None:
        if len(self.queue) >= self.queue_limit:
            raise QueueFullError(f"the prefill queue is full ({self.queue_limit} prompts waiting)")
        try:
            frame = pack(job)
        except (msgspec.EncodeError, ValueError, TypeError, OverflowError) as err:
            raise UnsendableJobError(f"the request holds a value that cannot be sent to a worker: {err}") from None
        entry = Entry(job.priority, job.deadline or math.inf, next(self.counter), job, frame)
        heapq.heappush(self.queue, entry)
        self._dispatch()
        if self.queue and self.queue[0] is entry:
            self._preempt_for(entry)
        self._announce()

    def _preempt_for(self, entry: Entry) -> None:
        """Stop the lowest-priority prefill in progress if it ranks strictly below this job."""
        busy = [w for w in self.workers.values() if w.state == "ready" and w.current is not None and not w.preempting]
        if not busy:
            return
        victim = max(busy, key=lambda w: (w.current.priority, w.current.deadline, w.current.arrival))
        if victim.current.priority <= entry.priority:
            return
        victim.preempting = True
        log.info("preempting prefill of %s (priority %d) on %s for %s (priority %d)", victim.current_id,
                 victim.current.priority, victim.name, entry.job.request_id, entry.priority)
        spawn(self._send(victim, CancelPrefill(victim.current_id)), f"cancel on {victim.name}", log)

    async def cancel(self, request_id: str) -> None:
        before = len(self.queue)
        self.queue = [entry for entry in self.queue if entry.job.request_id != request_id]
        if len(self.queue) != before:
            heapq.heapify(self.queue)
            self._announce()
            return
        for worker in self.workers.values():
            if worker.current_id == request_id:
                await self._send(worker, CancelPrefill(request_id))

    async def forget_salt(self, salt: str, timeout_s: float = 30.0) -> dict[str, SaltForgotten | None]:
        """Ask every ready worker to drop a salt's cached prompts (an operator deleting a tenant's); each worker's
        answer, None for one that did not answer in time (it does so between two prefills)."""
        waits = {}
        for worker in self.workers.values():
            if worker.state == "ready" and worker.writer is not None:
                future = asyncio.get_running_loop().create_future()
                self._forgetting[(worker.name, salt)] = future
                waits[worker.name] = future
                await self._send(worker, ForgetSalt(salt))
        answers = {}
        for name, future in waits.items():
            try:
                answers[name] = await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                answers[name] = None
            self._forgetting.pop((name, salt), None)
        return answers

    async def run(self) -> None:
        await asyncio.gather(*(self._maintain(w) for w in self.workers.values()))

    async def _maintain(self, worker: WorkerClient) -> None:
        await stay_connected(lambda: self._connect(worker), lambda streams: self._session(worker, streams),
                             lambda err: self._refused(worker, err))

    async def _connect(self, worker: WorkerClient) -> Streams:
        if self.resolve is not None:
            worker.address = await self.resolve(worker.name)
        return await connect_when_listening(worker.address, "gateway", "gateway", self.secret, self.connect_timeout_s)

    def _refused(self, worker: WorkerClient, err: Exception) -> None:
        repeated = str(err) == worker.last_error  # logged once: a worker down for minutes must not flood the log
        worker.state = "refused" if isinstance(err, PeerRefusedError) else "down"
        worker.last_error = str(err)
        (log.debug if repeated else log.error)("cannot connect to prefill worker %s at %s: %s", worker.name,
                                               worker.address, err)

    async def _session(self, worker: WorkerClient, streams: Streams) -> None:
        reader, worker.writer = streams
        worker.last_error = None
        try:
            await self._serve(worker, reader)
        except ProtocolError as err:
            worker.last_error = str(err)
            log.error("dropping prefill worker %s after a bad frame: %s", worker.name, err)
        finally:
            self._lost(worker)

    async def _serve(self, worker: WorkerClient, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                message = await asyncio.wait_for(read_message(reader), self.heartbeat_timeout_s)
            except TimeoutError:
                self._stuck(worker)
                return
            if message is None:
                return
            self._on_message(worker, message)

    def _on_message(self, worker: WorkerClient, message) -> None:
        if isinstance(message, (WorkerStatus, Heartbeat)):
            worker.engine_connected = message.engine_connected
        if isinstance(message, Heartbeat):
            worker.cache_tiers = message.cache_tiers
        if isinstance(message, WorkerStatus):
            worker.info, worker.state = message, "ready"
            log.info("prefill worker %s ready (%s, KV %s)", worker.name, worker.address, message.kv_type)
        elif isinstance(message, (PrefillDone, PrefillFailed, EmbedDone)):
            self._finished(worker, message)
        elif isinstance(message, SaltForgotten):
            future = self._forgetting.pop((worker.name, message.salt), None)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, PromptLogprobs):  # the job goes on: its PrefillDone follows
            self.registry.deliver(message.request_id, message)
        elif not isinstance(message, Heartbeat):
            log.warning("ignoring an unexpected %s frame from %s", type(message).__name__, worker.name)
        self._dispatch()
        self._announce()

    def _stuck(self, worker: WorkerClient) -> None:
        """Silent past the heartbeat timeout: its job must not wait for it."""
        worker.stuck_count += 1
        worker.last_error = f"no heartbeat for {self.heartbeat_timeout_s:.0f} s"
        log.error("prefill worker %s is stuck (%s); holding %s", worker.name, worker.last_error, worker.current_id)
        entry, worker.current, worker.preempting = worker.current, None, False
        restarted = self.on_stuck(worker.name)
        request = self.registry.get(entry.job.request_id) if entry is not None else None
        # its own prefill, or a recompute of a preempted choice (the request is decoding meanwhile)
        waiting = request is not None and (request.status == RequestStatus.PREFILLING
                                           or entry.job.resume_index >= 0 and not request.status.terminal)
        if waiting:
            if restarted:  # it is killed, so it cannot hand this prompt off as well: another worker takes it
                heapq.heappush(self.queue, entry)
            else:
                self.registry.deliver(entry.job.request_id, PrefillFailed(
                    entry.job.request_id, "worker_stuck", f"prefill worker {worker.name} stopped responding"))
        worker.state = "stuck"

    def _finished(self, worker: WorkerClient, message: PrefillDone | PrefillFailed | EmbedDone) -> None:
        entry, preempted = worker.current, worker.preempting
        if worker.current_id == message.request_id:
            worker.current, worker.preempting = None, False
        if isinstance(message, PrefillFailed) and message.kind == "cancelled" and preempted and entry:
            heapq.heappush(self.queue, entry)  # preempted, not failed: back in its old place
            return
        if isinstance(message, PrefillDone):
            self._record(message)
        self.registry.deliver(message.request_id, message)

    def drop(self, name: str, reason: str) -> None:
        """The worker is known to be gone (its Ray actor died): fail its job now, not when TCP notices."""
        worker = self.workers[name]
        worker.last_error = reason
        if worker.writer is not None:
            worker.writer.close()  # the read loop ends, _lost fails the job, _maintain reconnects

    def _lost(self, worker: WorkerClient) -> None:
        if worker.state not in ("down", "stuck") and not self.closing:
            log.error("lost prefill worker %s", worker.name)
        worker.state = "down" if worker.state != "stuck" else "stuck"
        worker.writer, worker.info = None, None
        if worker.current is not None:
            request_id = worker.current_id
            self.registry.deliver(request_id, PrefillFailed(
                request_id, "worker_died", f"prefill worker {worker.name} died while prefilling this request"))
            worker.current, worker.preempting = None, False
        self._dispatch()
        self._announce()

    def _announce(self) -> None:
        """Tell the listener the best priority among prompts queued or prefilling, when it changes."""
        ranks = [entry.priority for entry in self.queue]
        ranks += [w.current.priority for w in self.workers.values() if w.current is not None]
        best = min(ranks, default=None)
        if best != self.best_priority:
            self.best_priority = best
            self.on_best_priority(best)
        # prompts wait while every ready worker is busy (none ready: nothing prefills; one idle: it is not a backlog)
        ready = [w for w in self.workers.values() if w.state == "ready"]
        backlog = bool(self.queue) and bool(ready) and all(w.current is not None for w in ready)
        if backlog != self.backlog:
            self.backlog = backlog
            self.on_backlog(backlog)

    def _record(self, done: PrefillDone) -> None:
        if done.prefill_ms > 0:
            rate = done.num_prompt_tokens / (done.prefill_ms / 1e3)
            self.tokens_per_s = rate if self.tokens_per_s == 0 else 0.7 * self.tokens_per_s + 0.3 * rate

    def _dispatch(self) -> None:
        tried: set[str] = set()  # free workers no job was found for this round
        while (worker := next((w for w in self.workers.values() if w.state == "ready" and w.current is None
                               and w.name not in tried), None)) is not None:
            tried.add(worker.name)
            # embeddings and rerank jobs need no engine: they go to a worker whatever the engine's state
            entry = self._next_live_entry(pooled_only=not worker.engine_connected)
            if entry is None:
                continue
            # a recompute goes back to the engine that preempted it; a new prompt to the engine chosen now
            engine = entry.job.engine if entry.job.resume_index >= 0 or _pooled(entry.job) else \
                self.choose_engine(entry.job.request_id)
            if engine is None:  # no engine ready: a worker's next message (a heartbeat at the latest) tries again
                heapq.heappush(self.queue, entry)
                entry = self._next_live_entry(pooled_only=True)  # an embeddings job may still go
                if entry is None:
                    continue
                engine = entry.job.engine
            if engine != entry.job.engine:
                job = replace(entry.job, engine=engine)
                entry = replace(entry, job=job, frame=pack(job))
            request = self.registry.get(entry.job.request_id)
            chosen = self._preferred(entry, request, worker)
            if chosen is not worker:  # the free one may take the next job
                tried.discard(worker.name)
                worker = chosen
            worker.current = entry
            request.advance(RequestStatus.PREFILLING)
            request.prefill_started_at = time.perf_counter()
            request.worker = worker.name
            self.affinity.remember(request.prefix_key, worker.name)
            spawn(self._send_frame(worker, entry.frame), f"sending a job to {worker.name}", log)

    def _preferred(self, entry: Entry, request, free: WorkerClient) -> WorkerClient:
        """The worker that last prefilled a prompt beginning like this one, when it is free too: its prompt cache
        holds that conversation (and the answer's KV the engine returned to it), another worker's does not."""
        name = self.affinity.get(request.prefix_key)
        other = self.workers.get(name) if name is not None else None
        if other is None or other is free or other.state != "ready" or other.current is not None:
            return free
        return other if other.engine_connected or _pooled(entry.job) else free

    def _next_live_entry(self, pooled_only: bool = False) -> Entry | None:
        """The best job still wanted; pooled_only: the best embeddings or rerank job (the others stay queued)."""
        skipped, found = [], None
        while self.queue:
            entry = heapq.heappop(self.queue)
            request = self.registry.get(entry.job.request_id)
            if request is None or request.status.terminal:
                continue
            if pooled_only and not _pooled(entry.job):
                skipped.append(entry)
                continue
            found = entry
            break
        for entry in skipped:
            heapq.heappush(self.queue, entry)
        return found

    async def _send(self, worker: WorkerClient, message) -> None:
        await self._send_frame(worker, pack(message))

    async def _send_frame(self, worker: WorkerClient, frame: bytes) -> None:
        """A lost connection is the maintain loop's to handle: it fails the job and reconnects."""
        writer = worker.writer
        if writer is None:
            return
        try:
            writer.write(frame)
            await writer.drain()
        except (OSError, RuntimeError) as err:  # OSError: a reset, or ssl.SSLError once TLS saw an altered record
            log.warning("sending to prefill worker %s failed: %s", worker.name, err)
            writer.close()


def _pooled(job: PrefillJob) -> bool:
    """An embeddings or rerank job: a worker answers it alone, no engine takes part."""
    return job.task in ("embed", "rank")
