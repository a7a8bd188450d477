"""Ollama's API (/api/...) for the clients that speak it (issue 45 item 6): being built; no route is added yet."""

from __future__ import annotations

from aiohttp import web


def add_routes(app: web.Application) -> None:
    """The /api/... routes; none yet."""
