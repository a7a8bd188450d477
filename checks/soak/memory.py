"""Memory and processes over the soak: every process of the service (descendants included) sampled for RSS, the
growth of each from its first window to its last sample, and the processes still running after the service
stopped."""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

from checks.soak.service import Service
from server_process import wait_for

RSS_GROWTH_LIMIT = 0.10
SAMPLE_PERIOD_S = 2.0


class RssSampler:
    """RSS of every process of the service, every SAMPLE_PERIOD_S until `over` is set."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.samples: dict[tuple[str, int], list[tuple[float, int]]] = {}  # (name, pid) -> [(t, rss)]
        self.procs: dict[int, tuple[str, psutil.Process]] = {}  # every process ever seen
        self.over = False

    def loop(self) -> None:
        while not self.over:
            self.sample()
            time.sleep(SAMPLE_PERIOD_S)  # a fixed sampling period, not a wait for an event

    def sample(self) -> None:
        server = self.service.server
        health = self.service.health() or {}
        pids = {"gateway": server.process.pid}
        pids.update({name: p["pid"] for name, p in health.get("processes", {}).items() if p.get("pid")})
        try:  # anything else the service started (grandchildren included) must go when it stops, too
            kids = psutil.Process(server.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        named = set(pids.values())
        pids.update({f"descendant {k.pid}": k.pid for k in kids if k.pid not in named})
        for name, pid in pids.items():
            try:
                process = self.procs.setdefault(pid, (name, psutil.Process(pid)))[1]
                rss = process.memory_info().rss
            except psutil.NoSuchProcess:  # killed by a fault just now
                continue
            if not rss:  # a zombie, not reaped yet: it has exited
                continue
            self.samples.setdefault((name, pid), []).append((self.service.now(), rss))


@dataclass
class RssRow:
    name: str
    pid: int
    start_s: float | None
    start_mib: float | None
    end_s: float
    end_mib: float
    note: str = ""

    @property
    def growth(self) -> float | None:
        return None if self.start_mib is None else self.end_mib / self.start_mib - 1


def rss_rows(samples: dict, warmup_s: float, end_s: float) -> list[RssRow]:
    """Each process that ran from the start: from the highest RSS of its first `warmup_s` (the soak's first
    minute) to its last sample, the soak's end or just before a fault killed it. The high-water mark, not one
    sample: the allocator moves RSS in steps of tens of MiB as handoff buffers come and go, and a leak still
    shows as growth beyond it. A process a fault started is listed, not compared: it missed the warm-up, so
    its first prompts grow it; one killed before 1.5 windows is too short-lived to compare."""
    rows, first_t = [], min((series[0][0] for series in samples.values()), default=0.0)
    for (name, pid), series in sorted(samples.items(), key=lambda item: item[1][0][0]):
        born, (last_t, last_rss) = series[0][0], series[-1]
        base = max(((rss, t) for t, rss in series if t <= born + warmup_s), default=None)
        row = RssRow(name, pid, None, None, last_t, last_rss / 2 ** 20)
        if born > first_t + SAMPLE_PERIOD_S + 1:
            row.note = f"started by a fault at {born:.0f} s: not compared"
        elif last_t - born < 1.5 * warmup_s:
            row.note = f"lived {born:.0f}-{last_t:.0f} s: too short to compare"
        else:
            row.start_s, row.start_mib = base[1], base[0] / 2 ** 20
        if last_t < end_s - 5:
            row.note = (row.note + "; " if row.note else "") + "killed by a fault"
        rows.append(row)
    return rows


def leftovers(procs: dict[int, tuple[str, psutil.Process]]) -> list[str]:
    """Processes seen during the soak that are still running (a zombie has exited: not counted)."""
    def alive(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    wait_for(lambda: not any(alive(p) for _, p in procs.values()), 15, 0.2)
    return [f"{name} (pid {p.pid})" for name, p in procs.values() if alive(p)]
