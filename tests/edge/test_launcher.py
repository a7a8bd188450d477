"""The supervisor with tiny real child processes: backoff and crash loops, stable runs, shutdown, pdeathsig."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edge.launch.child_main import PARENT_PID_ENV
from edge.launch.launcher import NEVER_READY_STOP_S, Backoff, Supervisor, describe_exit, ready_probe
from server_process import pid_alive, wait_for

REPO = Path(__file__).resolve().parents[2]

# Run through edge.launch.child_main like the real children. Each start appends "pid monotonic-time" to the log
# (after any signal setup, so a line means the child is ready), then behaves as its mode says.
CHILD_MODULE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from pathlib import Path

    mode, log = sys.argv[1], Path(sys.argv[2])
    starts_before = len(log.read_text().splitlines()) if log.exists() else 0
    if mode == "abort_at_load":  # as llama.cpp does on a model it cannot take: a message, then abort()
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with log.open("a") as f:
            f.write(f"{os.getpid()} {time.monotonic()}\\n")
        print("loading the model", file=sys.stderr)
        print(f"GGML_ASSERT(n_layer <= 1024) failed at start {starts_before + 1}", file=sys.stderr, flush=True)
        os.abort()
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(str(log) + ".grandchild").write_text(str(grandchild.pid))
    with log.open("a") as f:
        f.write(f"{os.getpid()} {time.monotonic()}\\n")
    if mode == "exit" or (mode.startswith("fail_first_") and starts_before < int(mode.rsplit("_", 1)[1])):
        sys.exit(3)
    while True:
        time.sleep(60)
""")


@pytest.fixture
def child_log(tmp_path, monkeypatch):
    """Factory: child_log(name) -> the log path of a child; makes the child module importable by children."""
    (tmp_path / "launcher_child.py").write_text(CHILD_MODULE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    return lambda name: tmp_path / f"{name}.log"


def starts(log: Path) -> list[tuple[int, float]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(pid), float(t)) for pid, t in (line.split() for line in lines)]


async def until(predicate, timeout_s: float = 30.0) -> bool:
    """Like wait_for, but lets the supervisor's watch loop run meanwhile. Its deadline is only how long a failing
    test takes: generous, for a loaded machine that may not run this process for a second."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


@contextlib.asynccontextmanager
async def supervising(backoff: Backoff, **options):
    supervisor = Supervisor(backoff=backoff, poll_interval_s=0.01, **options)
    watcher = asyncio.create_task(supervisor.watch())
    try:
        yield supervisor
    finally:
        await supervisor.shutdown(timeout_s=2.0)
        watcher.cancel()


def test_a_crashing_child_is_restarted_with_doubling_delays_and_shows_a_crash_loop(child_log):
    backoff = Backoff(initial_s=0.2, max_s=0.8, stable_after_s=30.0, crash_loop_after=3)

    async def scenario() -> dict[int, dict]:
        # consecutive failures -> the snapshot taken as the exit is reported, in the tick that scheduled the restart
        # (a poll of the snapshot could come late on a busy machine, or miss a whole wait)
        waits: dict[int, dict] = {}

        def record(name: str, code: int) -> None:
            snap = supervisor.children[name].snapshot()
            waits.setdefault(snap["consecutive_failures"], snap)
        async with supervising(backoff, on_exit=record) as supervisor:
            supervisor.add("crasher", "launcher_child", ["exit", str(child_log("crasher"))])
            assert await until(lambda: len(waits) >= 5)
        return waits

    waits = asyncio.run(scenario())
    delays = [0.2, 0.4, 0.8, 0.8, 0.8]  # doubling, capped at max_s
    for failures, delay in enumerate(delays, start=1):
        snap = waits[failures]
        # taken microseconds after the restart was scheduled; above delay / 2 still tells each delay from the one
        # before it (no doubling) and at most delay from the one after (no cap)
        assert delay / 2 < snap["next_start_in_s"] <= delay, (failures, snap)
        assert snap["state"] == ("backoff" if failures < 3 else "crash_loop")
        assert (snap["pid"], snap["uptime_s"], snap["last_exit"], snap["restarts"]) == (None, None, 3, failures - 1)
    times = [t for _, t in starts(child_log("crasher"))]
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    assert all(gap >= delay for gap, delay in zip(gaps, delays)), gaps  # no restart came before its time


def test_a_stable_run_resets_the_consecutive_failures_but_not_the_restart_count(child_log):
    # stable_after_s: longer than a failing start takes on a loaded machine (an interpreter's start and exit), or
    # such a start would count as stable and reset the count itself
    backoff = Backoff(initial_s=0.05, max_s=5.0, stable_after_s=3.0, crash_loop_after=3)

    async def scenario() -> None:
        exits: list[dict] = []  # the snapshot as each exit is reported: a poll could miss a 0.05 s wait

        def record(name: str, code: int) -> None:
            exits.append(supervisor.children[name].snapshot())
        async with supervising(backoff, on_exit=record) as supervisor:
            child = supervisor.add("flaky", "launcher_child", ["fail_first_3", str(child_log("flaky"))])
            assert await until(lambda: child.restarts == 3 and child.consecutive_failures == 0)
            assert [e["consecutive_failures"] for e in exits] == [1, 2, 3]  # three quick failures counted
            stable = child.snapshot()
            assert stable["state"] == "running" and stable["restarts"] == 3 and stable["uptime_s"] >= 3.0
            os.kill(stable["pid"], signal.SIGKILL)
            assert await until(lambda: len(exits) == 4)
            after_crash = exits[-1]
            # the first failure after a stable run waits initial_s, not 2 ** 3 * initial_s
            assert after_crash["state"] == "backoff" and after_crash["consecutive_failures"] == 1
            assert after_crash["next_start_in_s"] <= 0.05 and after_crash["last_exit"] == -signal.SIGKILL
            assert await until(lambda: child.state == "running")
            assert child.snapshot()["restarts"] == 4

    asyncio.run(scenario())


def test_one_child_waiting_for_its_backoff_does_not_delay_restarting_another(child_log):
    """The crasher waits 60 s; the sleeper, killed meanwhile, is back long before (a watch loop that slept through
    the crasher's wait would restart it only after the crasher, 60 s on: past until's 30 s)."""
    async def scenario() -> None:
        async with supervising(Backoff(initial_s=60.0, max_s=60.0, stable_after_s=300.0)) as supervisor:
            crasher = supervisor.add("crasher", "launcher_child", ["exit", str(child_log("crasher"))])
            sleeper = supervisor.add("sleeper", "launcher_child", ["sleep", str(child_log("sleeper"))])
            assert await until(lambda: crasher.next_start_at is not None)
            assert crasher.snapshot()["next_start_in_s"] > 30.0
            # the sleeper's restart, scheduled from now on, waits 0.05 s (doubling to 60 s would take as long)
            supervisor.backoff = Backoff(initial_s=0.05, max_s=60.0, stable_after_s=300.0)
            old_pid = sleeper.process.pid
            os.kill(old_pid, signal.SIGKILL)
            assert await until(lambda: sleeper.process is not None and sleeper.process.pid != old_pid)
            assert crasher.process is None and crasher.consecutive_failures == 1  # still waiting

    asyncio.run(scenario())


def test_a_child_waiting_for_its_backoff_is_not_started_after_shutdown(child_log):
    async def scenario() -> None:
        # a 60 s backoff: a poll made late by a busy machine still finds it waiting (0.5 s could have passed, and
        # the restart with it); the tick below stands for its end
        supervisor = Supervisor(backoff=Backoff(initial_s=60.0), poll_interval_s=0.01)
        watcher = asyncio.create_task(supervisor.watch())
        child = supervisor.add("crasher", "launcher_child", ["exit", str(child_log("crasher"))])
        assert await until(lambda: child.state == "backoff")
        await supervisor.shutdown(timeout_s=1.0)
        await asyncio.wait_for(watcher, 30.0)  # the watch loop ends by itself (a loop that did not never would)
        supervisor._tend(child, time.monotonic() + 120.0)  # a tick after the backoff would have expired
        assert child.process is None
        assert child.snapshot()["state"] == "stopped" and child.snapshot()["next_start_in_s"] is None
        with pytest.raises(RuntimeError):
            supervisor.add("late", "launcher_child", ["sleep", str(child_log("late"))])

    asyncio.run(scenario())
    assert len(starts(child_log("crasher"))) == 1


def test_shutdown_kills_a_child_that_ignores_sigterm_and_what_it_started(child_log):
    log = child_log("stubborn")

    async def scenario() -> tuple[int, float]:
        supervisor = Supervisor(poll_interval_s=0.01)
        child = supervisor.add("stubborn", "launcher_child", ["ignore_term", str(log)])
        assert await until(lambda: starts(log))  # SIGTERM is ignored from now on
        began = time.monotonic()
        await supervisor.shutdown(timeout_s=0.3)
        assert child.state == "stopped"
        return starts(log)[0][0], time.monotonic() - began

    pid, took_s = asyncio.run(scenario())
    grandchild = int(Path(str(log) + ".grandchild").read_text())
    assert took_s >= 0.3  # it waited for the SIGTERM before killing
    assert not pid_alive(pid)
    assert wait_for(lambda: not pid_alive(grandchild), 30.0)  # reparented, so reaped by init once killed


SUPERVISOR_PROCESS = textwrap.dedent("""
    import asyncio, sys
    from edge.launch.launcher import Supervisor

    async def main():
        supervisor = Supervisor()
        child = supervisor.add("sleeper", "launcher_child", ["sleep", sys.argv[1]])
        print(child.process.pid, flush=True)
        await supervisor.watch()

    asyncio.run(main())
""")


def test_children_die_when_the_supervisor_process_is_killed(child_log):
    log = child_log("orphan")
    parent = subprocess.Popen([sys.executable, "-c", SUPERVISOR_PROCESS, str(log)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert wait_for(lambda: starts(log), 20.0)  # the trampoline has set PR_SET_PDEATHSIG
        assert pid_alive(pid)
        parent.send_signal(signal.SIGKILL)  # no shutdown() runs
        parent.wait()
        assert wait_for(lambda: not pid_alive(pid), 30.0)
    finally:
        parent.kill()
        parent.wait()


def test_the_trampoline_runs_the_module_only_while_its_supervisor_lives(child_log):
    log = child_log("direct")
    argv = [sys.executable, "-m", "edge.launch.child_main", "launcher_child", "exit", str(log)]
    ours = subprocess.run(argv, env={**os.environ, PARENT_PID_ENV: str(os.getpid())}, timeout=30)
    assert ours.returncode == 3 and len(starts(log)) == 1  # ran the module with its arguments
    gone = subprocess.run(argv, env={**os.environ, PARENT_PID_ENV: str(os.getpid() + 1)}, timeout=30)
    assert gone.returncode == 1 and len(starts(log)) == 1  # a parent other than the one expected: not run


def test_children_spin_briefly_between_parallel_regions_unless_the_operator_says_otherwise(monkeypatch):
    """Sleeping between the ops of a CPU decode step (OMP_WAIT_POLICY=PASSIVE) made it 1.7x as slow; a bounded
    spin (GOMP_SPINCOUNT) keeps it fast. An operator's wait policy or spin count wins."""
    from edge.launch.launcher import OMP_SPIN_COUNT, child_environment
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = child_environment()
    assert env["GOMP_SPINCOUNT"] == OMP_SPIN_COUNT and "OMP_WAIT_POLICY" not in env
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    assert child_environment()["GOMP_SPINCOUNT"] == "500"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = child_environment()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env


def test_the_engine_gets_the_pace_from_the_serve_config():
    """The launcher hands the engine one typed config, which the engine process reads back whole."""
    from contracts.process_config import config_argv
    from decode_gpu.service.server import parse_args
    from edge.config import ServeConfig
    from edge.launch.launcher import engine_config
    config = engine_config(ServeConfig(cpu_decode_pace_ms=100), "m.gguf", "unix:/x", "/run/cpu-share")
    assert parse_args(config_argv(config)) == config
    assert (config.cpu_decode_pace_ms, config.listen, config.cpu_share_file) == (100.0, "unix:/x", "/run/cpu-share")
    assert engine_config(ServeConfig(), "m.gguf", "unix:/x").cpu_decode_pace_ms == 0.0
    # 0 and unset both leave the pool's size to the engine
    assert engine_config(ServeConfig(kv_cache_tokens=0), "m.gguf", "unix:/x").kv_cache_tokens is None


def test_a_child_that_dies_at_every_start_before_it_was_ready_fails_the_start(child_log):
    """Not restarted in a loop: after Backoff.start_attempts deaths before it was ever ready, the start fails with
    its exit and its stderr's last words, once; the supervisor then leaves it stopped."""
    failures: list[str] = []
    backoff = Backoff(initial_s=0.01, max_s=0.05, start_attempts=3)

    async def scenario():
        supervisor = Supervisor(backoff=backoff, poll_interval_s=0.01, is_ready=lambda name: False,
                                on_start_failed=failures.append)
        watcher = asyncio.create_task(supervisor.watch())
        try:
            child = supervisor.add("prefill-0", "launcher_child", ["abort_at_load", str(child_log("aborter"))])
            assert await until(lambda: child.state == "failed", 30.0)
            supervisor._tend(child, time.monotonic() + 60.0)  # a tick long after any backoff: nothing restarts it
            return supervisor, child.snapshot()
        finally:
            await supervisor.shutdown(timeout_s=1.0)
            watcher.cancel()

    supervisor, snapshot = asyncio.run(scenario())
    assert len(starts(child_log("aborter"))) == 3
    assert failures == [supervisor.start_failure]
    assert failures[0].startswith("prefill-0 exited with signal SIGABRT (an abort, e.g. an assertion in native "
                                  "code) during its start, 3 times in a row, before it was ever ready; its last words:")
    assert "GGML_ASSERT(n_layer <= 1024) failed at start 3" in failures[0]
    assert (snapshot["state"], snapshot["last_exit"], snapshot["next_start_in_s"]) == ("failed", -signal.SIGABRT,
                                                                                       None)


def test_a_child_that_was_ready_once_is_restarted_however_often_it_dies(child_log):
    """Readiness seen once: later deaths are a crash loop, restarted with backoff as before, never a failed start."""
    ready = {"flaky": False}
    backoff = Backoff(initial_s=0.01, max_s=0.02, stable_after_s=30.0, start_attempts=2)

    async def scenario() -> Supervisor:
        supervisor = Supervisor(backoff=backoff, poll_interval_s=0.01, is_ready=ready.get)
        watcher = asyncio.create_task(supervisor.watch())
        try:
            child = supervisor.add("flaky", "launcher_child", ["sleep", str(child_log("flaky"))])
            assert await until(lambda: child.state == "running")
            ready["flaky"] = True
            assert await until(lambda: child.ready)
            for _ in range(4):
                killed = child.process.pid
                os.kill(killed, signal.SIGKILL)
                assert await until(lambda old=killed: child.process is not None and child.process.pid != old)
            assert child.consecutive_failures == 4 and child.state != "failed"
            return supervisor
        finally:
            await supervisor.shutdown(timeout_s=1.0)
            watcher.cancel()

    assert asyncio.run(scenario()).start_failure is None


def test_a_never_ready_child_that_ignores_sigterm_is_killed_within_a_second(child_log):
    """One stuck in a model load holds no request: shutdown does not wait its full timeout for it."""
    log = child_log("loading")

    async def scenario() -> float:
        supervisor = Supervisor(poll_interval_s=0.01, is_ready=lambda name: False, stop_timeout_s=30.0)
        supervisor.add("decode_engine", "launcher_child", ["ignore_term", str(log)])
        assert await until(lambda: starts(log))
        began = time.monotonic()
        await supervisor.shutdown()
        return time.monotonic() - began

    took_s = asyncio.run(scenario())
    # it waits NEVER_READY_STOP_S; 9 s more for a busy machine still tells it from the stop_timeout_s of 30 s
    assert NEVER_READY_STOP_S <= took_s < NEVER_READY_STOP_S + 9.0
    assert not pid_alive(starts(log)[0][0])


def test_the_start_failure_names_the_exit():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(-signal.SIGABRT).startswith("signal SIGABRT (an abort")


def test_the_ready_probe_reads_the_gateways_connections():
    from types import SimpleNamespace
    gateway = SimpleNamespace(pool=SimpleNamespace(workers={"prefill-0": SimpleNamespace(state="down")}),
                              engine=SimpleNamespace(state="connecting"))
    is_ready = ready_probe(gateway)
    assert not is_ready("prefill-0") and not is_ready("decode_engine")
    gateway.pool.workers["prefill-0"].state, gateway.engine.state = "ready", "ready"
    assert is_ready("prefill-0") and is_ready("decode_engine")
