"""Start and supervise the decode engine and prefill worker processes.

Children die with the gateway (PR_SET_PDEATHSIG), a dead child is logged, shown in /health and restarted
with backoff, and shutdown sends SIGTERM, then SIGKILL to whatever has not exited in time.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("edge.launcher")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: shutdown() still stops the children


def child_environment() -> dict[str, str]:
    """OpenMP threads that busy-wait between parallel regions (torch's and ggml's) starve each other when
    prefill and CPU decode share cores; passive waiting keeps both fast. An operator's setting wins."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    state: str = "starting"  # starting | running | restarting | stopped
    last_exit: int | None = None
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, on_exit=None) -> None:
        self.children: dict[str, Child] = {}
        self.on_exit = on_exit  # callback(name, returncode) so the gateway can fail that child's requests
        self.stopping = False

    def add(self, name: str, module: str, args: list[str]) -> Child:
        child = Child(name, [sys.executable, "-m", module, *args])
        self.children[name] = child
        self._start(child)
        return child

    def _start(self, child: Child) -> None:
        child.process = subprocess.Popen(child.argv, preexec_fn=_die_with_parent, env=child_environment())
        child.started_at = time.monotonic()
        child.state = "starting" if child.restarts == 0 else "restarting"
        log.info("started %s (pid %d)", child.name, child.process.pid)

    async def watch(self) -> None:
        while not self.stopping:
            await asyncio.sleep(0.25)
            for child in self.children.values():
                code = child.process.poll() if child.process else None
                if code is None or self.stopping:
                    if code is None and child.process is not None:
                        child.state = "running"
                    continue
                child.last_exit, child.process = code, None
                child.restarts += 1
                child.state = "restarting"
                log.error("%s exited with code %s; restarting (restart #%d)", child.name, code, child.restarts)
                if self.on_exit:
                    self.on_exit(child.name, code)
                await asyncio.sleep(min(5.0, 0.5 * child.restarts))
                if not self.stopping:
                    self._start(child)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self.stopping = True
        live = [c for c in self.children.values() if c.process and c.process.poll() is None]
        for child in live:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in live:
            while child.process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if child.process.poll() is None:
                log.warning("%s did not stop in %.0f s; killing it", child.name, timeout_s)
                child.process.kill()
                child.process.wait()
            child.state = "stopped"
        log.info("all child processes stopped")
