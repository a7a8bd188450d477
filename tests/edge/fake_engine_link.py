"""A decode engine link for gateway tests: answers what the gateway asks of edge.core.engine_link.EngineLink, with
no connection behind it; it remembers what it was told."""

from __future__ import annotations

from contracts.events import EngineStats


class FakeEngine:
    def __init__(self, state: str = "ready", stats: EngineStats | None = None) -> None:
        self.state = state
        self.last_error: str | None = None
        self.stats = stats
        self.speculation = True
        self.closing = False
        self.aborted: list[str] = []
        self.yield_to: int | None = None
        self.backlog = False

    async def run(self) -> None:
        pass

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def choose(self, request_id: str) -> str | None:
        return ""

    def speculation_changed(self, enabled: bool) -> None:
        self.speculation = enabled

    def prefill_priority_changed(self, priority: int | None) -> None:
        self.yield_to = priority

    def prefill_backlog_changed(self, backlog: bool) -> None:
        self.backlog = backlog

    def links(self) -> dict:
        return {}  # no single engine connection behind it

    def describe(self) -> None:
        return None
