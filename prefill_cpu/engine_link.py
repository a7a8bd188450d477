"""The prefill worker's connection to the decode engine, kept up in the background.

A worker outlives its engine: when the connection drops, the prompt in prefill is aborted at once (its
KV would have nowhere to go), jobs fail with engine_unavailable while the engine is away, and the link
reconnects with backoff (a restarted engine listens again once its model is loaded). The engine sends
nothing on this connection; end of stream is how its death shows.
"""

from __future__ import annotations

import asyncio
import logging

from contracts.framing import PeerRefusedError, ProtocolError, RetryDelay, connect_when_listening, send_message

log = logging.getLogger("prefill_cpu.engine_link")
RETRY_S = (0.2, 2.0)  # reconnect backoff: first and longest wait (an engine restart takes seconds)
CONNECT_TIMEOUT_S = 15.0  # a TCP peer that drops SYNs would otherwise hold one try for minutes


class EngineUnavailableError(ConnectionError):
    """The decode engine is not connected, or its connection dropped while a handoff was sent."""


class EngineLink:
    def __init__(self, address: str, name: str, secret: bytes, retry_s: tuple[float, float] = RETRY_S) -> None:
        self.address = address
        self.name = name
        self.secret = secret
        self.retry_s = retry_s
        self.writer: asyncio.StreamWriter | None = None
        # bumped on every lost connection; the prefill thread compares it to abort a prompt (an int read is atomic)
        self.num_losses = 0
        self.last_error: str | None = None
        self._up = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    async def wait_connected(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self.connected

    async def run(self) -> None:
        """Forever: connect, hold the connection until it drops, wait, again."""
        retry = RetryDelay(*self.retry_s)
        while True:
            connection = await self._connect()
            if connection is None:
                await retry.wait(failed=True)
                continue
            retry.succeeded()
            await self._hold(*connection)

    async def send(self, message) -> None:
        writer = self.writer
        if writer is None or writer.is_closing():
            raise EngineUnavailableError(f"the decode engine ({self.address}) is not connected to this worker")
        try:
            await send_message(writer, message)
        except (ConnectionError, RuntimeError) as err:
            raise EngineUnavailableError(f"the decode engine connection dropped during the handoff: {err}") from None

    async def _connect(self):
        """One try (the backoff is run's); (reader, writer) or None."""
        try:
            return await asyncio.wait_for(connect_when_listening(
                self.address, "prefill", self.name, self.secret, timeout_s=0), CONNECT_TIMEOUT_S)
        except PeerRefusedError as err:  # before OSError: it is a ConnectionError
            self._failed(f"the decode engine refused this worker: {err}")
        except (OSError, asyncio.TimeoutError, ProtocolError) as err:
            self._failed(f"cannot connect to the decode engine at {self.address}: {err!r}")
        return None

    def _failed(self, error: str) -> None:
        """Logged once per distinct error: an engine down for minutes must not flood the log."""
        (log.debug if error == self.last_error else log.warning)("%s; retrying", error)
        self.last_error = error

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer, self.last_error = writer, None
        self._up.set()
        log.info("connected to the decode engine at %s", self.address)
        try:
            while await reader.read(1 << 16):
                pass
        except ConnectionError:
            pass
        finally:
            self.writer = None
            self._up.clear()
            self.num_losses += 1
            writer.close()
        log.error("lost the decode engine at %s; jobs fail with engine_unavailable until it is back", self.address)
