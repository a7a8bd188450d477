"""What the processes of `edge serve` hold now against what the memory plan gave them (contracts/memory_plan.py), for
/health: each process's RSS and PSS (PSS counts a page shared by n processes as 1/n of it in each: the workers' one
mapping of the GGUF is counted once over all of them), the total, and the plan's budgets and parts.

`edge serve` stores its plan under MEMORY_PLAN (edge/cli.py); the /health handler adds `memory_report(app, supervisor)`.
"""

from __future__ import annotations

import os
import time

import psutil
from aiohttp import web

from contracts.memory_plan import MemoryPlan

MEMORY_PLAN = web.AppKey("memory_plan", MemoryPlan)  # the plan this start was made within; absent: none was made
MAX_AGE_S = 2.0  # a report this young is served again: reading every process's smaps is not free at each poll


def process_memory(pids: dict[str, int], plan: MemoryPlan | None) -> dict:
    """{"processes": {name: {"pid", "rss", "pss"}}, "total": {"rss", "pss"}, "plan": ...} for the processes named
    in `pids` (a gone one is left out); pss is None where the system has no PSS (not Linux). The plan: each budget,
    what the plan puts there, and its parts; None without one."""
    processes = {}
    for name, pid in pids.items():
        held = _held(pid)
        if held is not None:
            processes[name] = {"pid": pid, **held}
    pss = [p["pss"] for p in processes.values()]
    total = {"rss": sum(p["rss"] for p in processes.values()), "pss": None if None in pss else sum(pss)}
    return {"processes": processes, "total": total, "plan": _plan(plan)}


def _held(pid: int) -> dict | None:
    try:
        process = psutil.Process(pid)
        try:
            full = process.memory_full_info()
            return {"rss": full.rss, "pss": getattr(full, "pss", None)}
        except psutil.AccessDenied:
            return {"rss": process.memory_info().rss, "pss": None}
    except psutil.NoSuchProcess:
        return None


def _plan(plan: MemoryPlan | None) -> dict | None:
    if plan is None:
        return None
    return {"budgets": dict(plan.budgets), "planned": {where: plan.used(where) for where in plan.budgets},
            "parts": [{"name": p.name, "bytes": p.bytes, "where": p.where} for p in plan.parts]}


def served_pids(supervisor) -> dict[str, int]:
    """The gateway, the children its supervisor runs (by name), and any other child of the gateway (its grammar
    compile processes), by module and pid."""
    pids = {"gateway": os.getpid()}
    if supervisor is not None:
        pids.update({name: child.process.pid for name, child in supervisor.children.items()
                     if child.process is not None})
    known = set(pids.values())
    for child in psutil.Process().children(recursive=True):
        if child.pid not in known:
            pids[f"child {child.pid}"] = child.pid
    return pids


class MemoryReport:
    """process_memory for an app, served again while MAX_AGE_S young."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._at, self._report = float("-inf"), None

    def __call__(self, pids: dict[str, int], plan: MemoryPlan | None) -> dict:
        now = self.clock()
        if self._report is None or now - self._at >= MAX_AGE_S:
            self._at, self._report = now, process_memory(pids, plan)
        return self._report


MEMORY_REPORTS = web.AppKey("memory_reports", MemoryReport)  # set with MEMORY_PLAN, before the app starts


def memory_report(app: web.Application, supervisor=None) -> dict:
    """/health's "memory": the served processes' RSS and PSS and the plan of this start (`supervisor`: the app's
    edge.launch.launcher.Supervisor, if any); an app without MEMORY_REPORTS reads them at every call."""
    reports = app.get(MEMORY_REPORTS) or process_memory
    return reports(served_pids(supervisor), app.get(MEMORY_PLAN))
