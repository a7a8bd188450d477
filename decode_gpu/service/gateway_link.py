"""The engine's outgoing side of one gateway connection: a queue bounded in bytes, drained by one task.

The engine makes token events at its own pace; a gateway that cannot keep up must not make the engine
buffer without bound. Frames wait here, in order, until the one sender task has written them and the
socket drained; when the queue would pass its limit the connection is dropped instead (the gateway
reconnects and fails the requests it was streaming, saying the engine went away). A dropped link hands
back the terminal events it had not delivered, so the engine can keep them for the gateway's return.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from contracts.framing import pack
from contracts.messages import Token

log = logging.getLogger(__name__)
DEFAULT_QUEUE_BYTES = 32 << 20


class GatewayLink:
    def __init__(self, writer: asyncio.StreamWriter, max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 on_close: Callable[[GatewayLink, str], None] = lambda link, why: None) -> None:
        self.writer = writer
        self.max_queue_bytes = max_queue_bytes
        self.on_close = on_close  # called once, on the loop, when the link closes for any reason
        self.queue: collections.deque[tuple[bytes, object]] = collections.deque()  # (frame, message), oldest first
        self.num_queued_bytes = 0
        self.closed = False
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._sender = asyncio.ensure_future(self._send_all())

    def offer(self, frame: bytes, message) -> bool:
        """Queue a packed frame; False when the link is closed, or closes now because the gateway is too far
        behind. One frame always fits an empty queue (frames are bounded by the control frame cap)."""
        if self.closed:
            return False
        if self.queue and self.num_queued_bytes + len(frame) > self.max_queue_bytes:
            self.close(f"the gateway fell behind the token stream ({self.num_queued_bytes} bytes queued, "
                       f"limit {self.max_queue_bytes})")
            return False
        self.queue.append((frame, message))
        self.num_queued_bytes += len(frame)
        self._drained.clear()
        self._wakeup.set()
        return True

    def send(self, message) -> bool:
        return self.offer(pack(message), message)

    async def drained(self) -> None:
        """Until every queued frame was written and the socket drained (or the link closed)."""
        await self._drained.wait()

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self._sender.cancel()
        self.writer.transport.abort()  # drop, do not flush: a stuck peer would hold the buffer forever
        self._drained.set()
        self.on_close(self, why)

    def undelivered_endings(self) -> list[Token]:
        """Terminal events still queued, the one being written included (a duplicate ending is harmless; a
        lost one leaves a client waiting)."""
        return [message for _, message in self.queue
                if isinstance(message, Token) and message.event.finish_reason is not None]

    async def _send_all(self) -> None:
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                await self._send_queued()
                if not self.queue:
                    self._drained.set()
        except Exception as err:  # a reset peer, mostly; whatever it was, this connection is done
            self.close(f"sending to the gateway failed: {type(err).__name__}: {err}")

    async def _send_queued(self) -> None:
        while self.queue:
            frame, _ = self.queue[0]
            self.writer.write(frame)
            await self.writer.drain()
            self.queue.popleft()  # only now: a frame lost with the connection is still in the queue
            self.num_queued_bytes -= len(frame)
