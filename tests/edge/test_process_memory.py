"""/health's memory report (edge/observe/process_memory.py): each served process's RSS and PSS read from the
system, a gone process left out, the plan's budgets and parts beside them, and a report served again while young."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest
from aiohttp import web

from contracts.memory_plan import MemoryPlan, Part
from edge.observe.process_memory import (
    MEMORY_PLAN,
    MEMORY_REPORTS,
    MemoryReport,
    memory_report,
    process_memory,
    served_pids,
)

PLAN = MemoryPlan({"host": 8 << 30}, (Part("decode weights, int8", 1 << 30, "host"),
                                      Part("prefill workers x1", 512 << 20, "host")),
                  "auto", True, True, "f16", 1, 16384, 0)


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_each_process_is_read_from_the_system_and_a_gone_one_is_left_out(child):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    report = process_memory({"gateway": os.getpid(), "worker": child.pid, "gone": gone.pid}, PLAN)
    assert set(report["processes"]) == {"gateway", "worker"}
    for name, pid in (("gateway", os.getpid()), ("worker", child.pid)):
        held = report["processes"][name]
        full = psutil.Process(pid).memory_full_info()
        assert held["pid"] == pid and held["rss"] > 0 and 0 < held["pss"] <= held["rss"]
        assert abs(held["rss"] - full.rss) < 64 << 20  # read now: within what a test process may allocate meanwhile
    assert report["total"] == {"rss": sum(p["rss"] for p in report["processes"].values()),
                               "pss": sum(p["pss"] for p in report["processes"].values())}
    assert report["plan"] == {"budgets": {"host": 8 << 30}, "planned": {"host": (1 << 30) + (512 << 20)},
                              "parts": [{"name": "decode weights, int8", "bytes": 1 << 30, "where": "host"},
                                        {"name": "prefill workers x1", "bytes": 512 << 20, "where": "host"}]}
    assert process_memory({}, None) == {"processes": {}, "total": {"rss": 0, "pss": 0}, "plan": None}


def test_the_served_pids_are_the_gateway_its_supervised_children_and_its_other_children(child):
    supervisor = SimpleNamespace(children={"decode_engine": SimpleNamespace(process=child),
                                           "prefill-0": SimpleNamespace(process=None)})  # prefill-0 between starts
    assert served_pids(supervisor) == {"gateway": os.getpid(), "decode_engine": child.pid}
    assert served_pids(None) == {"gateway": os.getpid(), f"child {child.pid}": child.pid}


def test_a_young_report_is_served_again():
    now = [100.0]
    reports = MemoryReport(clock=lambda: now[0])
    first = reports({"gateway": os.getpid()}, PLAN)
    assert reports({}, None) is first
    now[0] += 2.0
    assert reports({}, None) == {"processes": {}, "total": {"rss": 0, "pss": 0}, "plan": None}


def test_the_app_report_carries_the_plan_of_this_start(child):
    app = web.Application()
    assert memory_report(app)["plan"] is None  # no plan made (launch = false, ray): the processes alone
    app[MEMORY_PLAN], app[MEMORY_REPORTS] = PLAN, MemoryReport()
    supervisor = SimpleNamespace(children={"decode_engine": SimpleNamespace(process=child)})
    report = memory_report(app, supervisor)
    assert set(report["processes"]) == {"gateway", "decode_engine"}
    assert report["plan"]["budgets"] == {"host": 8 << 30}
