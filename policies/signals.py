"""Load signals for tier conditions: engine and queue numbers passed in, box load read with psutil,
and a sliding window of recent time-to-first-token values."""

from __future__ import annotations

import collections
import time

import psutil


class TTFTWindow:
    def __init__(self, seconds: float = 30.0, clock=time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self.samples: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, ttft_s: float) -> None:
        self.samples.append((self.clock(), ttft_s))

    def p95(self) -> float:
        cutoff = self.clock() - self.seconds
        while self.samples and self.samples[0][0] < cutoff:
            self.samples.popleft()
        if not self.samples:
            return 0.0
        ordered = sorted(v for _, v in self.samples)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def box_signals() -> dict[str, float]:
    """CPU (since the previous call) and memory utilization of the whole box, in percent."""
    return {"cpu_percent": psutil.cpu_percent(interval=None), "memory_percent": psutil.virtual_memory().percent}
