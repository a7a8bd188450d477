"""Whether other work shared the CPU while this process measured something (a weight plan, speculation's costs).

A start records what it measured only when nothing else competed with the measurement; a later start reuses the
record instead of measuring in a noisy second (docs/decode.md, "Decisions measured while serving"). The 1-minute load
average answered that before, and it cannot: it trails by a minute and counts this very start (the model loading,
the prefill worker beside it), so a 2-core box coming out of its previous start never read as quiet. A window
counts what matters: the machine's busy CPU time across the measurement (/proc/stat, steal included: another
virtual machine took the core), less this process's own (every thread of it), in cores. Where /proc/stat cannot
be read, the load average stays the judge.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

QUIET_CORES = 0.25  # other work's average use of the CPU during a measurement, in cores, under which it was quiet
_USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s() -> float | None:
    """The machine's busy CPU seconds since boot, over all cores (/proc/stat: user, nice, system, irq, softirq,
    steal); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _USER_HZ


def load_average() -> float | None:
    """The 1-minute load average; None where the system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


class CpuWindow:
    """Opened before a measurement, asked after it: how many cores other work used meanwhile."""

    def __init__(self, busy: Callable[[], float | None] = machine_busy_s,
                 own: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic) -> None:
        self._busy, self._own, self._clock = busy, own, clock
        self._started = (clock(), busy(), own())
        self._load_before = load_average()
        self._closed, self._others = False, None  # the reading, taken when first asked (the window closes then)

    def others_cores(self) -> float | None:
        """Other work's average use of the CPU from the window's opening to the first time it is asked (so quiet(),
        describe() and a record written after them tell of the same interval), in cores; None where it cannot be
        told."""
        if not self._closed:
            self._closed = True
            began, busy_before, own_before = self._started
            busy_now, wall = self._busy(), self._clock() - began
            if busy_before is not None and busy_now is not None and wall > 0:
                self._others = max(0.0, (busy_now - busy_before) - (self._own() - own_before)) / wall
        return self._others

    def quiet(self) -> bool:
        """Whether the measurement had the CPU to itself: other work under QUIET_CORES through it; where that cannot
        be told, a 1-minute load average under half the cores before and after it."""
        others = self.others_cores()
        if others is not None:
            return others < QUIET_CORES
        half = 0.5 * (os.cpu_count() or 1)
        after = load_average()
        return self._load_before is not None and after is not None and max(self._load_before, after) < half

    def describe(self) -> str:
        others = self.others_cores()
        if others is not None:
            return f"other work used {others:.2f} of {os.cpu_count() or 1} cores through it"
        return f"load average {load_average()} on {os.cpu_count() or 1} cores"
