"""The gateway's connection to the decode engine: token events in, aborts out, stats kept for policies.

The connection survives anything a peer can send: a bad frame or a refused handshake is logged, the
connection dropped and made again (contracts.reconnect), and the requests it carried end with a clear error.

The engine's Stats frames (every 0.5 s, busy or not) are its heartbeat, as a prefill worker's Heartbeat is: an
engine silent for heartbeat_timeout_s (frozen, its process stopped, its loop wedged) is declared unresponsive,
shows so in /health, its requests end at once with a 503 (engine_unresponsive), and the connection is made again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from contracts.events import EngineStats, FinishReason
from contracts.framing import PeerRefusedError, ProtocolError, connect_when_listening, read_message, send_message
from contracts.messages import Abort, DecodeYield, Recompute, Speculate, Stats, Token
from contracts.reconnect import Streams, stay_connected
from contracts.tasks import spawn
from edge.core.lifecycle import InFlight, InFlightRegistry, RequestStatus

log = logging.getLogger("edge.core.engine_client")
HEARTBEAT_TIMEOUT_S = 5.0  # the engine sends Stats every 0.5 s


class EngineClient:
    def __init__(self, address: str, registry: InFlightRegistry, secret: bytes = b"",
                 name: str = "decode_engine", heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, *,
                 on_recompute: Callable[[Recompute, EngineClient], None] = lambda ask, client: None,
                 resolve: Callable[[], Awaitable[str]] | None = None, connect_timeout_s: float | None = None,
                 sole: bool = True) -> None:
        self.name = name
        self.address = address
        self.registry = registry
        self.secret = secret
        self.writer: asyncio.StreamWriter | None = None
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.state = "connecting"  # connecting | ready | unresponsive | down | refused
        self.unresponsive_count = 0
        self.last_error: str | None = None
        self.stats: EngineStats | None = None
        self.closing = False  # set at shutdown: a dropped connection is then expected
        self.yield_to: int | None = None  # best priority in prefill, as last told by the prefill pool
        self.backlog = False  # prompts wait for a free prefill worker, as last told by the prefill pool
        self.speculation = True  # the policy tier in force allows speculative decoding
        self.on_recompute = on_recompute  # the gateway has a preempted choice prefilled again
        # where this engine listens now, asked before each connection (a Ray actor moves when it restarts); None: fixed
        self.resolve = resolve
        self.connect_timeout_s = connect_timeout_s  # give up on an address after this long (then resolve again)
        # the only engine (single-box): the workers hand off to it unasked, and a request not yet given an engine is
        # bound for it; one of a group (edge.core.engine_group) owns only the requests chosen for it
        self.sole = sole
        # why a request bound for this engine cannot be served while it is not ready: (message, error code)
        self.outage = ("the decode engine is not connected (it is starting or restarting); retry shortly",
                       "engine_unavailable")

    def owns(self, request: InFlight) -> bool:
        """Whether the request's KV goes (or went) to this engine: it was chosen for it, or, as the only engine, it
        is a request that needs one (not an embeddings job) and was given no other."""
        return request.engine == self.name or (self.sole and not request.engine and request.needs_engine)

    def links(self) -> dict[str, EngineClient]:
        """The single engines behind this link, by name: this one alone (edge.core.engine_group has several)."""
        return {self.name: self}

    def describe(self) -> None:
        """One engine has no table of engines in /health: its state is the decode_engine component's."""
        return None

    def choose(self, request_id: str) -> str | None:
        """As a worker takes the request: the one engine is the workers' own (their --engine), so the job names none."""
        request = self.registry.get(request_id)
        if request is not None:
            request.engine = self.name
        return ""

    def job_address(self) -> str:
        """What a job handing off to this engine names: "" for the workers' own engine, else its address."""
        return "" if self.sole else self.address

    def handed_off(self, request: InFlight) -> None:
        """A worker reports the request's KV sent to this engine. While the gateway cannot hear the engine (frozen,
        restarting) its tokens could not reach the request, and the watchdog that ends the engine's requests has
        already run: the request ends now, as those did."""
        if self.state != "ready":
            message, code = self.outage
            self.registry.deliver_ending(request.request_id, FinishReason.ERROR, message, code)

    async def run(self) -> None:
        await stay_connected(self._connect, self._session, self._refused)

    async def _connect(self) -> Streams:
        if self.resolve is not None:
            self.address = await self.resolve()
        return await connect_when_listening(self.address, "gateway", "gateway", self.secret, self.connect_timeout_s)

    async def _session(self, streams: Streams) -> None:
        reader, writer = streams
        self.writer, self.state, self.last_error = writer, "ready", None
        log.info("connected to the decode engine at %s", self.address)
        # a restarted engine must hear what is in prefill now
        await self._send(DecodeYield(self.yield_to, self.backlog))
        if not self.speculation:
            await self._send(Speculate(False))  # ... and that the policy has speculation off
        try:
            await self._serve(reader)
        except ProtocolError as err:
            self.last_error = str(err)
            log.error("dropping the decode engine connection after a bad frame: %s", err)
        except TimeoutError:
            self._unresponsive()
        finally:
            self._lost()

    def _refused(self, err: Exception) -> None:
        repeated = str(err) == self.last_error  # logged once: an engine down for minutes must not flood the log
        self.state, self.last_error = ("refused" if isinstance(err, PeerRefusedError) else "down"), str(err)
        (log.debug if repeated else log.error)("cannot connect to the decode engine at %s: %s", self.address, err)

    def drop(self, reason: str) -> None:
        """The engine is known to be gone (its Ray actor died): end its requests now, not when TCP notices."""
        self.last_error = reason
        if self.writer is not None:
            self.writer.close()  # the read loop ends, _lost ends the requests, run() reconnects

    async def abort(self, request_id: str) -> None:
        await self._send(Abort(request_id))

    def speculation_changed(self, enabled: bool) -> None:
        """The policy tier in force allows speculative decoding, or not (it costs batch compute under load)."""
        self.speculation = enabled
        spawn(self._send(Speculate(enabled)), "telling the engine whether to speculate", log)

    def prefill_priority_changed(self, priority: int | None) -> None:
        """The prefill pool's best priority changed; the engine's less important decode yields to it."""
        self.yield_to = priority
        self._tell_prefill_state("the best priority in prefill")

    def prefill_backlog_changed(self, backlog: bool) -> None:
        """Prompts now wait (or no longer wait) for a free prefill worker."""
        self.backlog = backlog
        self._tell_prefill_state("the prefill backlog")

    def _tell_prefill_state(self, what: str) -> None:
        spawn(self._send(DecodeYield(self.yield_to, self.backlog)), f"telling the engine {what}", log)

    async def _send(self, message) -> None:
        """Best effort: a lost connection is handled by run(), which reconnects and resends the yield."""
        if self.writer is not None:
            try:
                await send_message(self.writer, message)
            except ConnectionError:
                pass

    async def _serve(self, reader: asyncio.StreamReader) -> None:
        while (message := await asyncio.wait_for(read_message(reader), self.heartbeat_timeout_s)) is not None:
            if isinstance(message, Token):
                self.registry.deliver(message.event.request_id, message.event)
            elif isinstance(message, Stats):
                self.stats = message.stats
            elif isinstance(message, Recompute):
                self.on_recompute(message, self)
            else:
                log.warning("ignoring an unexpected %s frame from the engine", type(message).__name__)

    def _unresponsive(self) -> None:
        """Silent past the heartbeat timeout: its requests must not wait for it."""
        self.unresponsive_count += 1
        self.last_error = f"the decode engine sent nothing for {self.heartbeat_timeout_s:g} s (frozen or wedged)"
        log.error("%s is unresponsive: %s", self.name, self.last_error)
        self.state = "unresponsive"
        self.outage = ("the decode engine stopped responding; retry shortly", "engine_unresponsive")
        # every request bound for it, not only those decoding: one a worker is prefilling would hand its KV to the
        # frozen engine (a large handoff blocks the worker's send for as long as the engine is stopped), and one
        # still queued for it would follow
        self._end_requests(*self.outage, RequestStatus.WAITING)

    def _lost(self) -> None:
        if not self.closing and self.state != "unresponsive":
            log.error("lost the decode engine connection")
        self.state = "unresponsive" if self.state == "unresponsive" else "down"
        if self.writer is not None:
            self.writer.close()  # a frozen engine's socket is let go, not left open
        self.writer, self.stats = None, None
        if self.state == "down":
            self.outage = ("the decode engine went away (it is restarting); retry shortly", "engine_unavailable")
        # those in prefill are failed by their worker, whose handoff finds the engine gone
        self._end_requests("the decode engine went away (it is restarting); retry shortly", "engine_unavailable",
                           RequestStatus.HANDED_OFF)

    def _end_requests(self, message: str, code: str, since: RequestStatus) -> None:
        """End this engine's requests from status `since` on (not those already ended)."""
        for request in list(self.registry.requests.values()):
            if since <= request.status <= RequestStatus.DECODING and self.owns(request):
                self.registry.deliver_ending(request.request_id, FinishReason.ERROR, message, code)
