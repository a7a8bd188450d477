"""The faults the soak injects into prefill-0 and the decode engine while the load runs, on a fixed plan, and how
long the service took to recover from each."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import psutil

from checks.soak.client import probe_classes
from checks.soak.service import POLICY, Service
from server_process import wait_for

FREEZE_S = 8.0  # SIGSTOP this long: well past worker_heartbeat_timeout_s, so the gateway must act
RECOVERY_BOUND_S = 120.0  # an engine restart loads the model on 2 busy cores
FAULT_CYCLE = ("kill_worker", "freeze_worker", "bad_policy", "kill_engine")  # FaultInjector's methods
VICTIM = "prefill-0"  # the worker that faults hit; prefill-1 serves meanwhile and lives through the whole soak
BAD_POLICY = "version = 1\n[filters\nblocked_words = [\n"  # not TOML: the reload must be refused


@dataclass
class Fault:
    name: str
    at_s: float
    target: str
    recovered_s: float | None = None  # None: not back within RECOVERY_BOUND_S
    note: str = ""
    broken: str = ""  # a promise the service broke during this fault


def fault_plan(duration_s: float) -> list[tuple[float, str]]:
    """(start time, fault): from 10 s on, at most every 30 s, none in the last 15 s (recovery needs time),
    cycling through the kinds. The engine is killed once, in its last slot (earlier ones kill the worker), so
    that the first engine lives long enough for its memory to be compared."""
    spacing = min(30.0, max(8.0, (duration_s - 20) / 4))
    times = [10 + i * spacing for i in range(int((duration_s - 25) // spacing) + 1)] if duration_s >= 25 else []
    kinds = [FAULT_CYCLE[i % len(FAULT_CYCLE)] for i in range(len(times))]
    engine = [i for i, kind in enumerate(kinds) if kind == "kill_engine"]
    kinds = [kind if kind != "kill_engine" or i == engine[-1] else "kill_worker" for i, kind in enumerate(kinds)]
    return list(zip(times, kinds))


class FaultInjector:
    """Injects fault_plan's faults until the load is over; `faults` holds each one's outcome."""

    def __init__(self, service: Service, load_over: threading.Event) -> None:
        self.service, self.load_over = service, load_over
        self.faults: list[Fault] = []
        self.running_at_kill = 0.0

    def loop(self, duration_s: float) -> None:
        for at, kind in fault_plan(duration_s):
            if self.load_over.wait(max(0.0, at - self.service.now())):
                return
            self.faults.append(getattr(self, kind)(VICTIM))

    def kill_worker(self, name: str) -> Fault:
        return self._kill("SIGKILL prefill worker", name)

    def kill_engine(self, _: str) -> Fault:
        # a kill between requests proves little: wait (briefly) until the engine holds decoding requests
        wait_for(lambda: self.service.metric("vllm:num_requests_running") > 0, 10, 0.1)
        fault = self._kill("SIGKILL decode engine", "decode_engine")
        fault.target += f", {self.running_at_kill:.0f} decoding"
        return fault

    def _kill(self, label: str, name: str) -> Fault:
        pid = self.service.pid_of(name)
        self.running_at_kill = self.service.metric("vllm:num_requests_running")
        fault = Fault(label, self.service.now(), f"{name} (pid {pid})")
        if pid is None:
            fault.note = "not running when the fault was due"
            return fault
        os.kill(pid, signal.SIGKILL)
        fault.recovered_s, _ = self.await_replaced(name, pid, fault.at_s)
        return fault

    def freeze_worker(self, name: str) -> Fault:
        pid = self.service.pid_of(name)
        fault = Fault(f"SIGSTOP prefill worker {FREEZE_S:.0f} s, then SIGCONT", self.service.now(),
                      f"{name} (pid {pid})")
        if pid is None:  # psutil.Process(None) would be the soak itself
            fault.note = "not running when the fault was due"
            return fault
        process = psutil.Process(pid)  # psutil checks the pid was not reused before it signals
        process.suspend()
        resume = threading.Timer(FREEZE_S, self._resume, (process, fault))
        resume.start()
        fault.recovered_s, down_s = self.await_replaced(name, pid, fault.at_s)
        resume.join()
        declared = f"declared not ready after {down_s:.1f} s; " if down_s is not None else "never declared stuck; "
        fault.note = declared + fault.note
        return fault

    @staticmethod
    def _resume(process: psutil.Process, fault: Fault) -> None:
        try:
            process.resume()
            fault.note = "SIGCONT reached the frozen process: it had not been killed"
        except psutil.NoSuchProcess:
            fault.note = "killed and restarted; the late SIGCONT found it gone"

    def await_replaced(self, name: str, old_pid: int, since: float) -> tuple[float | None, float | None]:
        """(seconds until a new process serves as `name` and /health is ok, seconds until it showed not ready)."""
        down_s, deadline = None, time.monotonic() + RECOVERY_BOUND_S
        while time.monotonic() < deadline:
            health = self.service.health() or {}
            ready = health.get("components", {}).get(name) == "ready"
            if down_s is None and health and not ready:
                down_s = self.service.now() - since
            pid = health.get("processes", {}).get(name, {}).get("pid")
            if ready and pid not in (None, old_pid) and health.get("status") == "ok":
                return self.service.now() - since, down_s
            time.sleep(0.2)  # polling another process's state: there is no event to await
        return None, down_s

    def bad_policy(self, _: str) -> Fault:
        """Recovery is timed from writing the good file back; the refusal's own delay goes in the note."""
        now = self.service.now
        fault = Fault("bad policy file (invalid TOML), then the good one", now(), "gateway (SIGHUP)")
        self.write_policy(BAD_POLICY)
        refused = wait_for(lambda: self._reload_error() is not None, 10, 0.1)
        refused_s, error = now() - fault.at_s, (self._reload_error() or "").split(": ", 1)[-1]
        served = probe_classes(self.service.server)  # the policy in force must keep serving every key meanwhile
        # the load is still running: a class at its concurrency limit answers 429, which proves its key and
        # class are still known; a lost policy would answer 401 (keys gone) or let everything through
        if any(outcome not in ("completed", "429 concurrency_limit") for outcome in served.values()):
            fault.broken = "with the bad file in place: " + ", ".join(f"{k}: {v}" for k, v in served.items())
        self.write_policy(POLICY)
        good_at = now()
        back = wait_for(lambda: self._reload_error() is None and (self.service.health() or {}).get("status") == "ok",
                        10, 0.1)
        fault.recovered_s = now() - good_at if back and refused else None
        fault.note = f"refused in {refused_s:.1f} s ({error[:80]})" if refused else "the bad file was NOT refused"
        fault.note += "" if fault.broken else "; every key was served meanwhile"
        return fault

    def write_policy(self, text: str) -> None:
        """Replace the file in one step (a half-written good file would be refused), then SIGHUP."""
        server = self.service.server
        tmp = server.policy.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, server.policy)
        os.kill(server.process.pid, signal.SIGHUP)

    def _reload_error(self) -> str | None:
        return ((self.service.health() or {}).get("policy") or {}).get("last_reload_error")
