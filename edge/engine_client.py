"""The gateway's connection to the decode engine: token events in, aborts out, stats kept for policies."""

from __future__ import annotations

import asyncio
import logging

from edge.lifecycle import InFlightRegistry, RequestStatus
from edge.protocol import (Abort, DecodeYield, Hello, Stats, Token, connect_when_listening, read_message,
                           send_message)

log = logging.getLogger("edge.engine_client")


class EngineClient:
    def __init__(self, address: str, registry: InFlightRegistry) -> None:
        self.address = address
        self.registry = registry
        self.writer: asyncio.StreamWriter | None = None
        self.state = "connecting"  # connecting | ready | down
        self.stats: dict | None = None
        self.closing = False  # set at shutdown: a dropped connection is then expected
        self.yield_to: int | None = None  # best priority in prefill, as last told by the prefill pool

    async def run(self) -> None:
        while True:
            reader, writer = await connect_when_listening(self.address, Hello("gateway"))
            self.writer, self.state = writer, "ready"
            log.info("connected to the decode engine at %s", self.address)
            await self._send(DecodeYield(self.yield_to))  # a restarted engine must hear what is in prefill now
            try:
                await self._serve(reader)
            finally:
                self._lost()
                writer.close()
            await asyncio.sleep(0.2)

    async def abort(self, request_id: str) -> None:
        await self._send(Abort(request_id))

    def prefill_priority_changed(self, priority: int | None) -> None:
        """The prefill pool's best priority changed; the engine's less important decode yields to it."""
        self.yield_to = priority
        asyncio.ensure_future(self._send(DecodeYield(priority)))

    async def _send(self, message) -> None:
        """Best effort: a lost connection is handled by run(), which reconnects and resends the yield."""
        if self.writer is not None:
            try:
                await send_message(self.writer, message)
            except ConnectionError:
                pass

    async def _serve(self, reader: asyncio.StreamReader) -> None:
        while (message := await read_message(reader)) is not None:
            if isinstance(message, Token):
                self.registry.deliver(message.event["request_id"], message.event)
            elif isinstance(message, Stats):
                self.stats = message.stats

    def _lost(self) -> None:
        if not self.closing:
            log.error("lost the decode engine connection")
        self.state, self.writer, self.stats = "down", None, None
        for request in list(self.registry.requests.values()):
            if request.status in (RequestStatus.HANDED_OFF, RequestStatus.DECODING):
                self.registry.deliver_ending(request.request_id, "error", "the decode engine went away")
