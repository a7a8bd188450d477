"""A measurement is recorded only when other work left the CPU to it: the window's arithmetic on set readings (the
machine's busy seconds, this process's own, the wall clock), the fallback without /proc/stat, and a real reading."""

import threading
import time

import pytest

from contracts import cpu_window
from contracts.cpu_window import QUIET_CORES, CpuWindow


def readings(*values: float):
    """A reader returning `values` in turn, the last one from then on."""
    left = list(values)
    return lambda: left.pop(0) if len(left) > 1 else left[0]


@pytest.mark.parametrize("busy_s, own_s, others", [(2.0, 2.0, 0.0), (2.0, 1.8, 0.1), (3.0, 1.0, 1.0), (1.0, 2.0, 0.0)])
def test_other_work_is_the_machines_busy_time_less_this_process_s(busy_s, own_s, others):
    """2 s of wall time: the machine busy busy_s seconds of CPU in all, this process own_s of them (more than the
    machine counted: clock ticks are coarser than process time, and that is no other work)."""
    window = CpuWindow(busy=readings(100.0, 100.0 + busy_s), own=readings(5.0, 5.0 + own_s), clock=readings(10.0, 12.0))
    assert window.others_cores() == pytest.approx(others)
    assert window.quiet() is (others < QUIET_CORES)
    assert f"other work used {others:.2f} of" in window.describe()


def test_without_proc_stat_the_load_average_judges(monkeypatch):
    loads = iter([0.1, 0.2, 0.2, 5.0, 5.0])
    monkeypatch.setattr(cpu_window, "load_average", lambda: next(loads))
    monkeypatch.setattr(cpu_window.os, "cpu_count", lambda: 2)
    assert CpuWindow(busy=lambda: None).quiet()  # 0.1 before, 0.2 after
    assert not CpuWindow(busy=lambda: None).quiet()  # 0.2 before, 5.0 after
    assert cpu_window.machine_busy_s() is None or cpu_window.machine_busy_s() >= 0


@pytest.mark.skipif(cpu_window.machine_busy_s() is None, reason="no /proc/stat")
def test_the_machines_busy_time_counts_this_process_s_work():
    """/proc/stat read right: while this process spins on every core for 0.3 s, the machine's busy seconds grow by
    at least half of what this process used (clock ticks are 10 ms; idle time would not grow at all)."""
    busy, own = cpu_window.machine_busy_s(), time.process_time()
    stop = time.monotonic() + 0.3
    spinners = [threading.Thread(target=_spin, args=(stop,)) for _ in range((cpu_window.os.cpu_count() or 1) - 1)]
    for spinner in spinners:
        spinner.start()
    _spin(stop)
    for spinner in spinners:
        spinner.join()
    used = time.process_time() - own
    assert used > 0.2 and cpu_window.machine_busy_s() - busy >= 0.5 * used


def _spin(stop: float) -> None:
    while time.monotonic() < stop:
        pass


def test_the_window_closes_when_first_asked():
    """quiet(), describe() and a record written after them tell of one interval: later readings change nothing."""
    window = CpuWindow(busy=readings(0.0, 0.1, 50.0), own=lambda: 0.0, clock=readings(0.0, 1.0, 100.0))
    assert window.others_cores() == pytest.approx(0.1) and window.quiet()
    assert window.others_cores() == pytest.approx(0.1) and "0.10 of" in window.describe()
