"""The engine's outgoing side: the connected gateways (one in practice), the requests whose stream they are owed,
and the endings kept while no gateway is connected. Asyncio side only.

Every event is packed once and offered to each link's queue, which is bounded in bytes (a gateway too far behind
is dropped, and reconnects). An ending no gateway took waits for the next one, bounded by count: the gateway may
still be waiting for it (a prompt in prefill during a reconnect), and one gone for good ends its own requests.
A request that can no longer stream (no gateway left, an event that cannot be encoded) is ended through
`end_request`, never dropped silently.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable

from contracts.events import FinishReason, TokenEvent
from contracts.framing import pack
from contracts.messages import Recompute, Token
from decode_gpu.service.gateway_link import DEFAULT_QUEUE_BYTES, GatewayLink

log = logging.getLogger("decode_gpu.service.server")
MAX_KEPT_ENDINGS = 10_000


class Gateways:
    def __init__(self, tokenizer, end_request: Callable[[str, str | None], None],
                 max_queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.tokenizer = tokenizer  # logprobs carry token text, which only this process can decode
        self.end_request = end_request  # (request id, why or None): ends a live request through the engine thread
        self.max_queue_bytes = max_queue_bytes  # per gateway connection, frames not yet written
        self.links: set[GatewayLink] = set()
        self.live: set[str] = set()  # requests opened and not yet ended: their stream is owed
        self.pending_endings: collections.OrderedDict[str, Token] = collections.OrderedDict()  # oldest first

    def open_link(self, writer: asyncio.StreamWriter) -> GatewayLink:
        """A gateway connected: it gets the endings kept for it first."""
        link = GatewayLink(writer, self.max_queue_bytes, self._on_link_closed)
        self.links.add(link)
        for request_id, message in list(self.pending_endings.items()):
            if not link.send(message):
                break  # the link closed; whatever it held went back to pending_endings
            del self.pending_endings[request_id]
        return link

    def send_events(self, events: list[TokenEvent]) -> None:
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

    def send_recomputes(self, asks: list[Recompute]) -> None:
        """To every gateway (there is one in practice); with none, the request has nobody to stream to anyway."""
        for ask in asks:
            frame = pack(ask)
            if not any([link.offer(frame, ask) for link in list(self.links)]):
                self.end_request(ask.request_id, "no gateway to have a preempted request recomputed")

    def broadcast(self, message) -> None:
        for link in list(self.links):
            link.send(message)

    async def flush(self, timeout_s: float) -> None:
        """Give queued events (the endings of a shutdown) a bounded time to reach the gateways."""
        await asyncio.sleep(0)  # run the engine thread's last call_soon_threadsafe callbacks first
        try:
            await asyncio.wait_for(asyncio.gather(*(link.drained() for link in self.links)), timeout_s)
        except TimeoutError:
            log.warning("gateways did not take the last events within %.0f s", timeout_s)

    def _frame(self, event: TokenEvent) -> tuple[Token, bytes] | None:
        """The event packed once for every gateway. One that cannot travel (text that msgpack refuses) ends its
        request with an error instead of vanishing: at once if it was the ending, else through the engine
        (None: nothing to send now)."""
        try:
            message = Token(with_token_text(event, self.tokenizer))
            return message, pack(message)
        except Exception as err:
            log.exception("cannot encode an event of request %s", event.request_id)
            why = f"cannot encode a token event ({type(err).__name__})"
            if event.finish_reason is None:
                self.end_request(event.request_id, why)
                return None
            message = Token(TokenEvent.ending(event.request_id, FinishReason.ERROR, why, event.num_prompt_tokens))
            return message, pack(message)

    def _keep_ending(self, message: Token) -> None:
        """No gateway to tell: keep terminal events for its return; a live sequence has nobody to stream to."""
        event = message.event
        if event.finish_reason is None:
            self.end_request(event.request_id, None)
            return
        self.pending_endings[event.request_id] = message
        while len(self.pending_endings) > MAX_KEPT_ENDINGS:
            self.pending_endings.popitem(last=False)

    def _on_link_closed(self, link: GatewayLink, why: str) -> None:
        """Endings it had not delivered wait for the next gateway. With no gateway left, the live requests have
        nobody to stream to (and missed tokens): they end as failed, saying why."""
        log.warning("gateway connection closed: %s", why)
        self.links.discard(link)
        for message in link.undelivered_endings():
            self._keep_ending(message)
        if not self.links:
            for request_id in list(self.live):
                self.end_request(request_id, f"decode stopped: {why}")


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
