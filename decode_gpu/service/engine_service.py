"""The engine process's two sides: the engine thread (steps, owns all engine state: engine_loop.EngineLoop) and
the asyncio side (sockets: EngineService here, delivery in gateways.Gateways). They meet in the engine loop's
inbox (commands.py: what the engine thread is asked to do), its `snapshot` (stats the engine thread publishes)
and call_soon_threadsafe (events back to the loop); the asyncio side never reads engine state.

A handoff's first token (sampled by the prefill worker) is sent the moment the handoff arrives, on the
asyncio side, not after the step in progress; the sequence then joins the engine between two steps.
Memory is bounded in bytes at each stage: handoffs waiting for the pool by the engine's backlog (a full
backlog refuses a handoff at once), events waiting for a gateway by its link's queue (a gateway too far
behind is dropped, and reconnects), endings kept for an absent gateway by count.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading

from contracts.cpu_share import CpuShare
from contracts.events import EngineStats, FinishReason, TokenEvent
from contracts.framing import CONTROL_FRAME_BYTES, ProtocolError, accept_peer, pack, read_message
from contracts.handoff import HandoffFormatError, decode_handoff
from contracts.messages import Abort, DecodeYield, Handoff, ReturnedKV, Speculate, Stats
from decode_gpu.core.admission import HandoffRejectedError
from decode_gpu.core.priority_gate import PriorityGate
from decode_gpu.engine import DecodeEngine
from decode_gpu.kv.kv_return import DEFAULT_RETURN_BYTES, KVReturn
from decode_gpu.service.commands import AbortRequest, Admit, Command, Resume, SetSpeculation
from decode_gpu.service.engine_loop import EngineLoop
from decode_gpu.service.gateway_link import DEFAULT_QUEUE_BYTES
from decode_gpu.service.gateways import Gateways
from decode_gpu.service.memory import MemoryAccount

log = logging.getLogger("decode_gpu.service.server")
STATS_INTERVAL_S = 0.5
MAX_EARLY_ABORTS = 10_000
MAX_ORIGINS = 10_000  # request id -> the worker connection its handoff came on, for its returned KV
MAX_WORKER_BUFFER = 64 << 20  # returned KV not yet taken by a worker's socket: past it, the next one is dropped


class EngineService:
    def __init__(self, engine: DecodeEngine, loop: asyncio.AbstractEventLoop, secret: bytes = b"",
                 max_handoff_frame: int = CONTROL_FRAME_BYTES, max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 cpu_share: CpuShare | None = None, pace_s: float = 0.0, account: MemoryAccount | None = None,
                 kv_return_bytes: int = DEFAULT_RETURN_BYTES) -> None:
        """account: the engine's memory by component, sent with the stats with its decisions (None: neither).
        kv_return_bytes: finished answers' KV waiting to go back to their prefill worker, at most (0: none goes)."""
        self.engine = engine  # the asyncio side only opens handoffs with it (Admission.open reads no engine state)
        self.loop = loop
        self.secret = secret
        self.max_handoff_frame = max_handoff_frame  # the model's largest possible handoff, framed
        self.gate: PriorityGate = engine.runner.gate or PriorityGate(enabled=False)
        self.stopping = threading.Event()
        self.gateways = Gateways(engine.tokenizer, self._on_abort, max_queue_bytes)
        self.engine_loop = EngineLoop(engine, loop, self.stopping, self.gateways.send_events,
                                      self.gateways.send_recomputes, self.gate, cpu_share, pace_s, account)
        self.aborted: collections.OrderedDict[str, None] = collections.OrderedDict()  # aborts seen before the handoff
        # request id -> the prefill worker's connection its handoff came on: its finished KV goes back there
        self.origins: collections.OrderedDict[str, asyncio.StreamWriter] = collections.OrderedDict()
        if kv_return_bytes > 0:
            engine.kv_return = KVReturn(lambda rid, data: loop.call_soon_threadsafe(self._return_kv, rid, data),
                                        kv_return_bytes)

    @property
    def snapshot(self) -> EngineStats:
        """The stats the engine thread published last."""
        return self.engine_loop.snapshot

    def run_engine(self) -> None:
        """The engine thread's work, until `stopping` is set."""
        self.engine_loop.run()

    def set_speculation(self, enabled: bool) -> None:
        """Turn speculative decoding off (a policy under load: drafts cost batch compute) or back on; the engine
        thread applies it between two steps."""
        self._ask(SetSpeculation(enabled))

    def _ask(self, command: Command) -> None:
        self.engine_loop.inbox.put(command)

    def _on_handoff(self, message: Handoff) -> None:
        request_id = message.request_id
        try:
            handoff = decode_handoff(message.data)
            if handoff.request_id != request_id:
                raise HandoffFormatError(f"the frame says request {request_id}, the handoff {handoff.request_id}")
        except HandoffFormatError as err:
            log.error("handoff %s is malformed: %s", request_id, err)
            why = f"malformed KV handoff: {err}"
            self.gateways.send_events([TokenEvent.ending(request_id, FinishReason.ERROR, why)])
            return
        if request_id in self.aborted:  # the client went away while it was being prefilled
            del self.aborted[request_id]
            ending = TokenEvent.ending(request_id, FinishReason.ABORT, num_prompt_tokens=handoff.n_tokens)
            self.gateways.send_events([ending])
            return
        if handoff.resume_index >= 0:  # a preempted choice's recompute: the engine thread takes it back
            self._ask(Resume(handoff))
            return
        try:
            if request_id in self.gateways.live:
                raise HandoffRejectedError(f"request id {request_id} is already decoding")
            seq, first = self.engine.open(handoff)  # refuses at once when the backlog is full
        except HandoffRejectedError as err:
            log.error("handoff %s rejected: %s", request_id, err)
            ending = TokenEvent.ending(request_id, FinishReason.ERROR, str(err), handoff.n_tokens, err.code)
            self.gateways.send_events([ending])
            return
        self.gateways.send_events(first)
        if seq is not None:
            self.gateways.live.add(request_id)
            self._ask(Admit(seq))

    def _return_kv(self, request_id: str, data: bytes) -> None:
        """On the loop: a finished answer's KV to the worker that prefilled it (dropped when it is gone or behind)."""
        writer = self.origins.pop(request_id, None)
        if writer is None or writer.is_closing():
            return
        if writer.transport.get_write_buffer_size() > MAX_WORKER_BUFFER:
            log.info("returned KV of %s dropped: its prefill worker is %d bytes behind", request_id,
                     writer.transport.get_write_buffer_size())
            return
        writer.write(pack(ReturnedKV(request_id, data)))

    def _on_abort(self, request_id: str, error: str | None = None) -> None:
        if request_id in self.gateways.live:
            self._ask(AbortRequest(request_id, error))
            return
        self.aborted[request_id] = None  # its handoff may still be in flight
        while len(self.aborted) > MAX_EARLY_ABORTS:
            self.aborted.popitem(last=False)

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await accept_peer(reader, writer, self.secret)
        if hello is None:
            log.warning("refused a control connection that failed the handshake")
            return
        limit = self.max_handoff_frame if hello.role == "prefill" else CONTROL_FRAME_BYTES
        link = self.gateways.open_link(writer) if hello.role == "gateway" else None
        why = ""
        try:
            await self._read_all(reader, limit, writer if hello.role == "prefill" else None)
        except ProtocolError as err:  # drop this peer; it reconnects
            log.error("dropping %s %s after a bad frame: %s", hello.role, hello.name, err)
            why = f"the gateway sent a bad frame: {err}"
        finally:
            if link is not None:
                self.gate.hold(None)  # whatever it asked for no longer holds
                link.close(why or "the gateway closed its connection")
            writer.close()

    async def _read_all(self, reader: asyncio.StreamReader, limit: int,
                        worker: asyncio.StreamWriter | None = None) -> None:
        while True:
            message = await read_message(reader, limit)
            if message is None:
                return
            if worker is not None and isinstance(message, Handoff) and self.engine.kv_return is not None:
                self.origins[message.request_id] = worker
                while len(self.origins) > MAX_ORIGINS:
                    self.origins.popitem(last=False)
            self._dispatch(message)
            del message  # a handoff frame is as big as its KV: not kept while waiting for the next one

    def _dispatch(self, message) -> None:
        if isinstance(message, Handoff):
            self._on_handoff(message)
        elif isinstance(message, Abort):
            self._on_abort(message.request_id)
        elif isinstance(message, DecodeYield):
            log.debug("best priority in prefill: %s, backlog: %s", message.priority, message.backlog)
            self.gate.backlog = message.backlog
            self.gate.hold(message.priority)
        elif isinstance(message, Speculate):
            self.set_speculation(message.enabled)
        else:
            log.warning("ignoring an unexpected %s frame", type(message).__name__)

    async def publish_stats(self) -> None:
        while not self.stopping.is_set():
            await asyncio.sleep(STATS_INTERVAL_S)
            self.gateways.broadcast(Stats(self.snapshot))

    async def flush(self, timeout_s: float) -> None:
        """Give queued events (the endings of a shutdown) a bounded time to reach the gateways."""
        await self.gateways.flush(timeout_s)
