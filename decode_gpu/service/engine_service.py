"""The engine process's two sides: the engine thread (steps, owns all engine state) and the asyncio side
(sockets). They meet in the inbox (commands to the engine thread), `snapshot` (stats the engine thread
publishes) and call_soon_threadsafe (events back to the loop); the asyncio side never reads engine state.

A handoff's first token (sampled by the prefill worker) is sent the moment the handoff arrives, on the
asyncio side, not after the step in progress; the sequence then joins the engine between two steps.
Memory is bounded in bytes at each stage: handoffs waiting for the pool by the engine's backlog (a full
backlog refuses a handoff at once), events waiting for a gateway by its link's queue (a gateway too far
behind is dropped, and reconnects), endings kept for an absent gateway by count.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time

from decode_gpu.engine import DecodeEngine, HandoffRejectedError
from decode_gpu.service.gateway_link import DEFAULT_QUEUE_BYTES, GatewayLink
from decode_gpu.core.priority_gate import PriorityGate
from contracts.cpu_share import CpuShare
from contracts.events import FinishReason, TokenEvent
from contracts.framing import CONTROL_FRAME_BYTES, ProtocolError, accept_peer, pack, read_message
from contracts.handoff import HandoffFormatError, decode_handoff
from contracts.messages import Abort, DecodeYield, Handoff, Recompute, Speculate, Stats, Token

log = logging.getLogger("decode_gpu.service.server")
STATS_INTERVAL_S = 0.5


class EngineService:
    def __init__(self, engine: DecodeEngine, loop: asyncio.AbstractEventLoop, secret: bytes = b"",
                 max_handoff_frame: int = CONTROL_FRAME_BYTES, max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 cpu_share: CpuShare | None = None, pace_s: float = 0.0) -> None:
        self.engine = engine
        self.cpu_share = cpu_share  # decode on the CPU: tells local prefill workers when it is decoding
        # decode on the CPU next to prefill workers: while prompts wait for a busy worker, a step starts at most
        # every pace_s (0: no pacing), so decode takes less of the cores and batches more sequences a step
        self.pace_s = pace_s
        self._step_started = 0.0
        self.gate: PriorityGate = engine.runner.gate or PriorityGate(enabled=False)
        self.loop = loop
        self.secret = secret
        self.max_handoff_frame = max_handoff_frame  # the model's largest possible handoff, framed
        self.max_queue_bytes = max_queue_bytes  # per gateway connection, frames not yet written
        # ("admit", Sequence), ("abort", (request id, error or None)) or ("speculate", bool), in arrival order. Its
        # handoffs' bytes are bounded by the engine's backlog, its aborts by the number of live requests.
        self.inbox: queue.Queue = queue.Queue()
        self.links: set[GatewayLink] = set()
        # terminal events of requests that ended while no gateway was connected; the gateway may still be
        # waiting for them (a prompt in prefill during a reconnect). Bounded: a gateway gone for good
        # ends its own requests, and the oldest endings go first.
        self.pending_endings: collections.OrderedDict[str, Token] = collections.OrderedDict()
        self.live: set[str] = set()  # opened and not yet ended (asyncio side)
        self.aborted: collections.OrderedDict[str, None] = collections.OrderedDict()  # aborts seen before the handoff
        self.snapshot = engine.stats()  # published by the engine thread; other threads never read engine state
        self.stopping = threading.Event()

    # --- engine thread -------------------------------------------------------------------------
    def run_engine(self) -> None:
        while not self.stopping.is_set():
            self._drain_inbox(block=not self.engine.has_work)
            if self.pace_s and self.engine.has_work:
                self._pace()
            if self.engine.has_work:
                self._step_started = time.monotonic()
                try:  # the engine fails a sequence, or a whole batch, itself; this is the last line
                    events = self.engine.step()
                except Exception as err:
                    log.exception("decode step failed")
                    events = self.engine.fail_all(f"decode step failed: {err}")
                self._publish(events)
                self._ask_for_recomputes()
            if self.cpu_share is not None:
                self.cpu_share.set_decoding(self.engine.best_running_priority)
            self.snapshot = self.engine.stats()
        self._drain_inbox(block=False)  # opened sequences still in the inbox end with the rest
        self._publish(self._abort_all())
        if self.cpu_share is not None:
            self.cpu_share.set_decoding(None)

    def _pace(self) -> None:
        """While prompts wait for a busy prefill worker on these cores, hold the next step until pace_s after the
        last one began, serving the inbox meanwhile (aborts end at once); the wait ends as soon as the backlog does."""
        while not self.stopping.is_set() and self.gate.backlog:
            left = self._step_started + self.pace_s - time.monotonic()
            if left <= 0:
                return
            self._drain_inbox(block=True, timeout_s=left)

    def _drain_inbox(self, block: bool, timeout_s: float = 0.1) -> None:
        try:
            item = self.inbox.get(timeout=timeout_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "speculate":
                self.engine.set_speculation(payload)
            elif kind == "resume":
                self._publish(self._resume(payload))
            else:
                self._publish(self._admit(payload) if kind == "admit" else self._abort(*payload))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, seq) -> list[TokenEvent]:
        try:
            self.engine.admit(seq)
            return []
        except HandoffRejectedError as err:
            return [TokenEvent.ending(seq.request_id, FinishReason.ERROR, str(err), seq.prompt_len, err.code)]

    def _resume(self, handoff) -> list[TokenEvent]:
        """A recompute came back: the preempted choice waits for admission again; one that does not fit ends."""
        try:
            self.engine.resume(handoff)
            return []
        except HandoffRejectedError as err:
            return self._abort(handoff.request_id, f"recomputing a preempted request failed: {err}")

    def _ask_for_recomputes(self) -> None:
        """Sequences preempted by recompute: the gateway has their tokens prefilled again at their priority."""
        asks = [Recompute(seq.request_id, seq.index, tuple(seq.tokens[:-1]), seq.sampling, seq.priority)
                for seq in self.engine.recompute_requests]
        self.engine.recompute_requests.clear()
        if asks:
            self.loop.call_soon_threadsafe(self._send_recomputes, asks)

    def _abort(self, request_id: str, error: str | None) -> list[TokenEvent]:
        event = self.engine.abort(request_id, error)
        return [] if event is None else [event]  # None: it ended on its own in the meantime

    def _abort_all(self) -> list[TokenEvent]:
        return [self.engine.abort(request_id) for request_id in list(self.engine.requests)]

    def _publish(self, events: list[TokenEvent]) -> None:
        if events:
            self.loop.call_soon_threadsafe(self._send_events, events)

    # --- asyncio side ------------------------------------------------------------------------
    def set_speculation(self, enabled: bool) -> None:
        """Turn speculative decoding off (a policy under load: drafts cost batch compute) or back on; the engine
        thread applies it between two steps."""
        self.inbox.put(("speculate", enabled))

    def _on_handoff(self, message: Handoff) -> None:
        request_id = message.request_id
        try:
            handoff = decode_handoff(message.data)
            if handoff.request_id != request_id:
                raise HandoffFormatError(f"the frame says request {request_id}, the handoff {handoff.request_id}")
        except HandoffFormatError as err:
            log.error("handoff %s is malformed: %s", request_id, err)
            self._send_events([TokenEvent.ending(request_id, FinishReason.ERROR, f"malformed KV handoff: {err}")])
            return
        if request_id in self.aborted:  # the client went away while it was being prefilled
            del self.aborted[request_id]
            self._send_events([TokenEvent.ending(request_id, FinishReason.ABORT, num_prompt_tokens=handoff.n_tokens)])
            return
        if handoff.resume_index >= 0:  # a preempted choice's recompute: the engine thread takes it back
            self.inbox.put(("resume", handoff))
            return
        try:
            if request_id in self.live:
                raise HandoffRejectedError(f"request id {request_id} is already decoding")
            seq, first = self.engine.open(handoff)  # refuses at once when the backlog is full
        except HandoffRejectedError as err:
            log.error("handoff %s rejected: %s", request_id, err)
            self._send_events([TokenEvent.ending(request_id, FinishReason.ERROR, str(err), handoff.n_tokens, err.code)])
            return
        self._send_events(first)
        if seq is not None:
            self.live.add(request_id)
            self.inbox.put(("admit", seq))

    def _on_abort(self, request_id: str, error: str | None = None) -> None:
        if request_id in self.live:
            self.inbox.put(("abort", (request_id, error)))
            return
        self.aborted[request_id] = None  # its handoff may still be in flight
        while len(self.aborted) > 10_000:
            self.aborted.popitem(last=False)

    def _send_events(self, events: list[TokenEvent]) -> None:
        for event in events:
            if event.finish_reason is not None:
                self.live.discard(event.request_id)
            framed = self._frame(event)
            if framed is None:
                continue
            message, frame = framed
            delivered = False
            for link in list(self.links):  # a gateway too far behind is dropped here, not buffered without end
                delivered = link.offer(frame, message) or delivered
            if not delivered:  # no gateway, or the only one was just dropped: it must not vanish
                self._keep_ending(message)

    def _send_recomputes(self, asks: list[Recompute]) -> None:
        """To every gateway (there is one in practice); with none, the request has nobody to stream to anyway."""
        for ask in asks:
            frame = pack(ask)
            if not any([link.offer(frame, ask) for link in list(self.links)]):
                self._on_abort(ask.request_id, "no gateway to have a preempted request recomputed")

    def _frame(self, event: TokenEvent) -> tuple[Token, bytes] | None:
        """The event packed once for every gateway. One that cannot travel (text that msgpack refuses) ends its
        request with an error instead of vanishing: at once if it was the ending, else through the engine
        (None: nothing to send now)."""
        try:
            message = Token(with_token_text(event, self.engine.tokenizer))
            return message, pack(message)
        except Exception as err:
            log.exception("cannot encode an event of request %s", event.request_id)
            why = f"cannot encode a token event ({type(err).__name__})"
            if event.finish_reason is None:
                self._on_abort(event.request_id, why)
                return None
            message = Token(TokenEvent.ending(event.request_id, FinishReason.ERROR, why, event.num_prompt_tokens))
            return message, pack(message)

    def _keep_ending(self, message: Token) -> None:
        """No gateway to tell: keep terminal events for its return; a live sequence has nobody to stream to."""
        event = message.event
        if event.finish_reason is None:
            self._on_abort(event.request_id)
            return
        self.pending_endings[event.request_id] = message
        while len(self.pending_endings) > 10_000:
            self.pending_endings.popitem(last=False)

    def _open_link(self, writer: asyncio.StreamWriter) -> GatewayLink:
        link = GatewayLink(writer, self.max_queue_bytes, self._on_link_closed)
        self.links.add(link)
        for request_id, message in list(self.pending_endings.items()):
            if not link.send(message):
                break  # the link closed; whatever it held went back to pending_endings
            del self.pending_endings[request_id]
        return link

    def _on_link_closed(self, link: GatewayLink, why: str) -> None:
        """Endings it had not delivered wait for the next gateway. With no gateway left, the live requests have
        nobody to stream to (and missed tokens): they end as failed, saying why."""
        log.warning("gateway connection closed: %s", why)
        self.links.discard(link)
        for message in link.undelivered_endings():
            self._keep_ending(message)
        if not self.links:
            for request_id in list(self.live):
                self._on_abort(request_id, f"decode stopped: {why}")

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await accept_peer(reader, writer, self.secret)
        if hello is None:
            log.warning("refused a control connection that failed the handshake")
            return
        limit = self.max_handoff_frame if hello.role == "prefill" else CONTROL_FRAME_BYTES
        link = self._open_link(writer) if hello.role == "gateway" else None
        why = ""
        try:
            await self._read_all(reader, limit)
        except ProtocolError as err:  # drop this peer; it reconnects
            log.error("dropping %s %s after a bad frame: %s", hello.role, hello.name, err)
            why = f"the gateway sent a bad frame: {err}"
        finally:
            if link is not None:
                self.gate.hold(None)  # whatever it asked for no longer holds
                link.close(why or "the gateway closed its connection")
            writer.close()

    async def _read_all(self, reader: asyncio.StreamReader, limit: int) -> None:
        while True:
            message = await read_message(reader, limit)
            if message is None:
                return
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
            message = Stats(self.snapshot)
            for link in list(self.links):
                link.send(message)

    async def flush(self, timeout_s: float) -> None:
        """Give queued events (the endings of a shutdown) a bounded time to reach the gateways."""
        await asyncio.sleep(0)  # run the engine thread's last call_soon_threadsafe callbacks first
        try:
            await asyncio.wait_for(asyncio.gather(*(link.drained() for link in self.links)), timeout_s)
        except asyncio.TimeoutError:
            log.warning("gateways did not take the last events within %.0f s", timeout_s)


def with_token_text(event: TokenEvent, tokenizer) -> TokenEvent:
    """Logprobs carry token text, which only this process can decode."""
    if not event.logprobs:
        return event

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    logprobs = tuple(dataclasses.replace(lp, token=text(lp.token_id),
                                         top=tuple(dataclasses.replace(t, token=text(t.token_id)) for t in lp.top))
                     for lp in event.logprobs)
    return dataclasses.replace(event, logprobs=logprobs)
