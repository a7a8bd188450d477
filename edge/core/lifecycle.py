"""One request's lifecycle in the gateway: an ordered status, and exactly one terminal state."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from contracts.events import FinishReason, TokenEvent


class RequestStatus(enum.IntEnum):
    WAITING = 0  # in the gateway's prefill queue
    PREFILLING = 1  # a prefill worker has it
    HANDED_OFF = 2  # its KV is on the way to, or queued in, the decode engine
    DECODING = 3  # tokens are flowing
    FINISHED = 4
    ABORTED = 5
    FAILED = 6

    @property
    def terminal(self) -> bool:
        return self >= RequestStatus.FINISHED


@dataclass
class InFlight:
    request_id: str
    priority: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # messages for the handler, in order
    status: RequestStatus = RequestStatus.WAITING
    created: float = field(default_factory=time.perf_counter)  # its model's load wait included (load_wait_s)
    load_wait_s: float = 0.0  # how long it waited for its model to load before admission ([[models]])
    worker: str = ""  # prefill worker holding it while PREFILLING
    engine: str = ""  # the decode engine chosen for it when it went to a worker (its KV goes there)
    needs_engine: bool = True  # False for an embeddings or rerank request: a worker answers it alone
    prefix_key: bytes | None = None  # its prompt's leading text, hashed: requests sharing it go to one engine
    cache_salt: str = ""  # whose cached prompts it may reuse (edge.core.cache_salt); its recomputes keep it
    num_prompt_tokens: int = 0  # prefilled, as its worker reported: counted against a quota even if it ends early
    prefill_started_at: float | None = None  # the last dispatch to a worker (a preempted prompt is dispatched again)
    handed_off_at: float | None = None  # the worker reported its handoff sent (or the first token came, if sooner)
    first_token_at: float | None = None
    last_token_at: float | None = None

    def ttft_breakdown(self) -> str:
        """Where the time to first token went: queue, prefill (+handoff), engine until the first token."""
        marks = (self.created, self.prefill_started_at, self.handed_off_at, self.first_token_at)
        if any(m is None for m in marks):
            return ""
        queued, prefill, engine = (b - a for a, b in zip(marks, marks[1:]))
        load = f"model load {self.load_wait_s * 1e3:.0f} ms, " if self.load_wait_s else ""
        return (f"{load}queued {(queued - self.load_wait_s) * 1e3:.0f} ms, prefill {prefill * 1e3:.0f} ms, "
                f"engine {engine * 1e3:.0f} ms")

    def advance(self, status: RequestStatus) -> bool:
        """Move forward; a terminal state is final. Returns False if the request had already ended."""
        if self.status.terminal:
            return False
        self.status = max(self.status, status) if not status.terminal else status
        return True


class InFlightRegistry:
    """Every accepted request until its terminal state; lets prefill, engine and handlers find it by id."""

    def __init__(self) -> None:
        self.requests: dict[str, InFlight] = {}

    def add(self, request: InFlight) -> None:
        self.requests[request.request_id] = request

    def get(self, request_id: str) -> InFlight | None:
        return self.requests.get(request_id)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def deliver(self, request_id: str, message) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.events.put_nowait(message)

    def deliver_ending(self, request_id: str, reason: FinishReason, error: str | None = None,
                       error_code: str = "") -> None:
        """An engine-style terminal event made by the gateway itself (shutdown, a lost engine)."""
        self.deliver(request_id, TokenEvent.ending(request_id, reason, error, error_code=error_code))

    def count(self, status: RequestStatus) -> int:
        return sum(1 for r in self.requests.values() if r.status == status)
