"""The one reconnect loop of the three control links: gateway -> decode engine (edge.core.engine_client), gateway ->
prefill workers (edge.core.prefill_pool), prefill worker -> decode engine (prefill_cpu.engine_link).

Each link keeps its connection up forever: connect (and pass the handshake), hold the connection until it drops,
wait a little, again. A failed try waits twice as long as the one before, up to RETRY_LONGEST_S, so a peer that is
away for minutes costs a try every few seconds; the first try after a drop, or after a success, comes soon, since a
restarted peer is usually back in seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NoReturn

from contracts.framing import PeerRefusedError, ProtocolError

RETRY_FIRST_S = 0.2  # after a drop, or after the first failed try
RETRY_LONGEST_S = 2.0  # the longest wait between tries: an engine restart takes seconds, a worker's less
# what a try can fail with: refused at the handshake (before OSError: it is a ConnectionError), a bad frame in it,
# nobody listening or reachable, no answer in time, and a peer whose address cannot be found now (Ray: LookupError)
CONNECT_ERRORS = (PeerRefusedError, ProtocolError, asyncio.TimeoutError, OSError, LookupError)

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class RetryDelay:
    """The wait between reconnect tries: doubles after each failure up to `longest`, back to `first` once a
    connection succeeded."""

    def __init__(self, first: float = RETRY_FIRST_S, longest: float = RETRY_LONGEST_S) -> None:
        self.first, self.longest = first, longest
        self.delay = first

    def succeeded(self) -> None:
        self.delay = self.first

    async def wait(self, failed: bool = False) -> None:
        await asyncio.sleep(self.delay)
        if failed:
            self.delay = min(self.longest, self.delay * 2)


async def stay_connected(connect: Callable[[], Awaitable[Streams]], hold: Callable[[Streams], Awaitable[None]],
                         failed: Callable[[Exception], None], retry: RetryDelay | None = None) -> NoReturn:
    """Forever: `connect()` (one try, handshake included), `hold(streams)` until the connection drops, wait, again.
    `failed(error)` hears every failed try (one of CONNECT_ERRORS); anything else is a bug and ends the loop."""
    retry = retry or RetryDelay()
    while True:
        try:
            streams = await connect()
        except CONNECT_ERRORS as err:
            failed(err)
            await retry.wait(failed=True)
            continue
        retry.succeeded()
        try:
            await hold(streams)
        finally:
            streams[1].close()
        await retry.wait()
