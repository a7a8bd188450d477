"""The prefill worker's connections to the decode engines, kept up in the background.

A worker outlives its engine: when the connection drops, the prompt in prefill is aborted at once (its
KV would have nowhere to go), jobs fail with engine_unavailable while the engine is away, and the link
reconnects with backoff (contracts.reconnect; a restarted engine listens again once its model is loaded). End of
stream is how the engine's death shows. The engine sends one kind of frame back: ReturnedKV, a finished answer's KV
of a request this worker prefilled, which `on_returned` (the worker's prompt cache) takes.

A worker may hand off to several engines (a Ray cluster: the gateway names the engine in each job). `EngineLinks`
keeps one link per engine address: the worker's own (`--engine`, up from startup, as on one box) and the others made
on a job's first use and reused after; a bounded number, the least recently used closed first.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable

from contracts.framing import PeerRefusedError, ProtocolError, connect_when_listening, read_message, send_message
from contracts.messages import ReturnedKV
from contracts.reconnect import RETRY_FIRST_S, RETRY_LONGEST_S, RetryDelay, Streams, stay_connected
from contracts.tasks import spawn

log = logging.getLogger("prefill_cpu.engine_link")
RETRY_S = (RETRY_FIRST_S, RETRY_LONGEST_S)  # tests shorten them
MAX_LINKS = 16  # links to engines named by jobs; an engine restarted elsewhere leaves a stale address behind
LINK_WAIT_S = 5.0  # a job's engine that the gateway sees up but this worker does not (yet): wait this long for it
STALE_LINK_S = 60.0  # a named link that is down and unused this long is closed (its engine moved or is gone)
MAX_RETURNED_FRAME = 1 << 30  # a returned answer's KV: an authenticated engine's, as large as a handoff can be


class EngineUnavailableError(ConnectionError):
    """The decode engine is not connected, or its connection dropped while a handoff was sent."""


class EngineLink:
    def __init__(self, address: str, name: str, secret: bytes, retry_s: tuple[float, float] = RETRY_S,
                 startup_wait_s: float = 0.0) -> None:
        self.address = address
        self.name = name
        self.secret = secret
        self.retry_s = retry_s
        # the first try waits this long for the engine to listen (trying as connect_when_listening does): a worker
        # started with its engine connects within a poll of the engine listening, not a backoff of up to
        # RETRY_LONGEST_S later
        self.startup_wait_s = startup_wait_s
        self.writer: asyncio.StreamWriter | None = None
        # bumped on every lost connection; the prefill thread compares it to abort a prompt (an int read is atomic)
        self.num_losses = 0
        self.last_error: str | None = None
        self._up = asyncio.Event()
        self.on_returned: Callable[[ReturnedKV], None] | None = None  # what takes a returned answer's KV

    @property
    def connected(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    async def wait_connected(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.connected

    async def run(self) -> None:
        """Forever: connect, hold the connection until it drops, wait, again (contracts.reconnect)."""
        await stay_connected(self._connect, self._hold, self._failed, RetryDelay(*self.retry_s))

    async def send(self, message) -> None:
        writer = self.writer
        if writer is None or writer.is_closing():
            raise EngineUnavailableError(f"the decode engine ({self.address}) is not connected to this worker")
        try:
            await send_message(writer, message)
        except (ConnectionError, RuntimeError) as err:
            raise EngineUnavailableError(f"the decode engine connection dropped during the handoff: {err}") from None

    async def _connect(self) -> Streams:
        """One try: the engine is expected to listen already (the backoff is stay_connected's), except on the first,
        which waits up to startup_wait_s for it."""
        wait_s, self.startup_wait_s = self.startup_wait_s, 0.0
        return await connect_when_listening(self.address, "prefill", self.name, self.secret, timeout_s=wait_s)

    def _failed(self, err: Exception) -> None:
        """Logged once per distinct error: an engine down for minutes must not flood the log."""
        if isinstance(err, PeerRefusedError):
            error = f"the decode engine refused this worker: {err}"
        else:
            error = f"cannot connect to the decode engine at {self.address}: {err!r}"
        (log.debug if error == self.last_error else log.warning)("%s; retrying", error)
        self.last_error = error

    async def _hold(self, streams: Streams) -> None:
        reader, self.writer = streams
        self.last_error = None
        self._up.set()
        log.info("connected to the decode engine at %s", self.address)
        try:
            while (message := await read_message(reader, MAX_RETURNED_FRAME)) is not None:
                if isinstance(message, ReturnedKV) and self.on_returned is not None:
                    self.on_returned(message)
        except ProtocolError as err:  # drop the link; it reconnects
            log.error("dropping the decode engine link after a bad frame: %s", err)
        except (ConnectionError, ssl.SSLError):  # TLS: a record altered on the way ends the link as a reset would
            pass
        finally:
            self.writer = None
            self._up.clear()
            self.num_losses += 1
        log.error("lost the decode engine at %s; jobs fail with engine_unavailable until it is back", self.address)


class EngineLinks:
    """The worker's links by engine address: its own (`default`, None for a worker without --engine) and the ones
    jobs name. One job at a time uses them (the worker's lock), so a link other than the one asked for is idle."""

    def __init__(self, default, name: str, secret: bytes, max_links: int = MAX_LINKS) -> None:
        self.default = default  # an EngineLink (or a stand-in in tests) that the worker's startup holds up
        self.name = name
        self.secret = secret
        self.max_links = max_links
        self.named: OrderedDict[str, tuple[EngineLink, asyncio.Task]] = OrderedDict()  # least recently used first
        self.last_used: dict[str, float] = {}

    @property
    def default_connected(self) -> bool:
        """What the worker tells the gateway: without an engine of its own, it can take any job."""
        return self.default is None or self.default.connected

    async def link_for(self, address: str) -> EngineLink | None:
        """The link to hand a job's KV to; connected unless the engine is away (None: no engine to use). The
        worker's own link answers at once, as on one box; a named one is given LINK_WAIT_S to (re)connect, since
        the gateway names only engines it is connected to."""
        if not address or address == getattr(self.default, "address", None):
            return self.default
        self._close_stale(keep=address)
        if address not in self.named:
            self._evict()
            link = EngineLink(address, self.name, self.secret)
            link.on_returned = getattr(self.default, "on_returned", None)
            self.named[address] = link, spawn(link.run(), f"the decode engine link to {address}", log)
        self.named.move_to_end(address)
        self.last_used[address] = time.monotonic()
        link = self.named[address][0]
        if not link.connected:
            await link.wait_connected(LINK_WAIT_S)
        return link

    def _evict(self) -> None:
        while len(self.named) >= self.max_links:
            self._close(next(iter(self.named)), "least recently used")

    def _close_stale(self, keep: str) -> None:
        now = time.monotonic()
        for address, (link, _) in list(self.named.items()):
            if address != keep and not link.connected and now - self.last_used[address] > STALE_LINK_S:
                self._close(address, "down and unused")

    def _close(self, address: str, why: str) -> None:
        _, task = self.named.pop(address)
        self.last_used.pop(address, None)
        task.cancel()  # stay_connected closes the connection
        log.info("closed the link to the decode engine at %s (%s)", address, why)

    def close(self) -> None:
        for address in list(self.named):
            self._close(address, "the worker stops")
