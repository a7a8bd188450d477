"""Seconds since this process started, for the start-up log lines of every process (`edge serve`'s gateway, the
decode engine, the prefill workers), so that an operator can see where start-up time goes (docs/decode.md,
"Start-up time"): interpreter and imports, model loads, the wait for a peer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil


def since_start() -> float:
    """Seconds since the kernel started this process (10 ms steps on Linux)."""
    try:  # both counted from boot: psutil's create_time adds the boot time, which Linux gives in whole seconds
        started_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        return max(0.0, time.time() - psutil.Process().create_time())
