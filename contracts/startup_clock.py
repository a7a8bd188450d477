"""Seconds since this process started, for the start-up log lines of every process (`edge serve`'s gateway, the
decode engine, the prefill workers), so that an operator can see where start-up time goes (docs/decode.md,
"Start-up time"): interpreter and imports, model loads, the wait for a peer."""

from __future__ import annotations

import time

import psutil


def since_start() -> float:
    """Wall seconds since the kernel started this process (psutil's create_time: 10 ms steps on Linux)."""
    return max(0.0, time.time() - psutil.Process().create_time())
