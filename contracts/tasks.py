"""Fire-and-forget tasks whose outcome is always retrieved: an exception is logged, never lost in the loop."""

from __future__ import annotations

import asyncio
import logging

_RUNNING: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones


def spawn(coro, what: str, log: logging.Logger) -> asyncio.Task:
    """Run coro in the background; if it fails, log `what` failed with the traceback."""
    task = asyncio.ensure_future(coro)
    _RUNNING.add(task)
    task.add_done_callback(lambda t: _retrieve(t, what, log))
    return task


def _retrieve(task: asyncio.Task, what: str, log: logging.Logger) -> None:
    _RUNNING.discard(task)
    if not task.cancelled() and (err := task.exception()) is not None:
        log.error("%s failed: %s", what, err, exc_info=err)
