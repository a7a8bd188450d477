"""What the gateway and its handlers know of the decode engine(s): one connection (edge.core.engine_client) or
several behind one interface (edge.core.engine_group) answer the same members. Tests pass fakes that answer them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from contracts.events import EngineStats

if TYPE_CHECKING:
    from edge.core.engine_client import EngineClient

EMPTY_STATS = EngineStats(0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0)  # an engine's stats before it has sent any


class EngineLink(Protocol):
    state: str  # connecting | ready | unresponsive | down | refused (a group: ready while any engine is)
    last_error: str | None  # why it is not ready, if known
    stats: EngineStats | None  # the last reported stats (a group: their sum); None while not connected
    speculation: bool  # the policy tier in force allows speculative decoding, as last told
    closing: bool  # set at shutdown: a dropped connection is then expected

    async def run(self) -> None:
        """Keep the connection(s) up until cancelled."""

    async def abort(self, request_id: str) -> None:
        """End the request in its engine (also a handoff still on its way there)."""

    def choose(self, request_id: str) -> str | None:
        """As a worker takes the request: the address its job hands off to ("" the worker's own), or None to keep
        the job queued (no engine can take it now)."""

    def speculation_changed(self, enabled: bool) -> None:
        """The policy tier in force allows speculative decoding, or not."""

    def prefill_priority_changed(self, priority: int | None) -> None:
        """The best priority among queued and prefilling prompts changed."""

    def prefill_backlog_changed(self, backlog: bool) -> None:
        """Prompts now wait (or no longer wait) for a free prefill worker."""

    def links(self) -> dict[str, EngineClient]:
        """The single engines behind it, by name: one connection is its own only one."""

    def describe(self) -> dict | None:
        """/health's table of the engines of a group, by name; None for one engine (its state is the component's)."""
