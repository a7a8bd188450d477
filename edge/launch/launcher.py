"""Start and supervise the decode engine and prefill worker processes.

Children die with the gateway (PR_SET_PDEATHSIG, set inside the child by edge.launch.child_main), a dead child is
logged, shown in /health and restarted after an exponential backoff that resets once the child has run
stably, and shutdown sends SIGTERM, then SIGKILL to whatever has not exited in time (a child that was never ready
has nothing to finish: it gets a second). A child that dies during its start, before it was ever ready, several
times in a row (a model llama.cpp aborts on) is not restarted in a loop: the start fails with its exit and the last
lines of its stderr (edge.launch.child_output), and the gateway exits with that reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from contracts.options import check
from contracts.process_config import Config, EngineProcessConfig, WorkerProcessConfig, config_argv
from edge.config import ServeConfig, default_threads
from edge.launch.child_main import PARENT_PID_ENV
from edge.launch.child_output import StderrTail

log = logging.getLogger("edge.launch.launcher")


# OpenMP threads spin this many rounds after a parallel region before they sleep (libgomp, which torch and ggml
# use). Long enough to bridge the gaps between the ops of one decode step: sleeping there (OMP_WAIT_POLICY=PASSIVE)
# made a CPU decode step 1.7x as slow (batch 8: 75.9 against 44.0 ms; batch 1: 42.5 against 21.3). Short enough
# that threads idle between steps, or yielding to a prefill, soon sleep: with decode and prefill splitting the cores
# (contracts/cpu_share.py) both run as fast as with passive waiting (bench.cpu_share_bench, docs/decode.md).
OMP_SPIN_COUNT = "10000"


def child_environment() -> dict[str, str]:
    """The environment of every child process. An operator's setting of any of these wins."""
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" not in env:  # an explicit wait policy decides the spinning itself
        env.setdefault("GOMP_SPINCOUNT", OMP_SPIN_COUNT)
    # glibc gives each thread that allocates its own arena and keeps freed memory there; with handoff-sized
    # buffers on several threads RSS then swings by tens of MiB and a leak cannot be told from the noise
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env[PARENT_PID_ENV] = str(os.getpid())  # edge.launch.child_main exits if its parent is already gone
    return env


def engine_config(config: ServeConfig, model_path: str, listen: str, cpu_share_file: str = "") -> EngineProcessConfig:
    """The decode engine's config: every setting it shares with the serve config, and where it sits."""
    return _child_config(EngineProcessConfig, config, model=model_path, listen=listen, cpu_share_file=cpu_share_file,
                         kv_cache_tokens=config.kv_cache_tokens or None)  # 0 and unset both mean "size it for me"


def worker_config(config: ServeConfig, model_path: str, name: str, listen: str, engine: str, kv_type: str,
                  threads: int, cpu_share_file: str = "") -> WorkerProcessConfig:
    """A prefill worker's config: every setting it shares with the serve config, its resolved KV type and threads,
    and where it sits."""
    return _child_config(WorkerProcessConfig, config, model=model_path, name=name, listen=listen, engine=engine,
                         kv_type=kv_type, threads_per_worker=threads, cpu_share_file=cpu_share_file)


def start_embedding_workers(supervisor: Supervisor, config: ServeConfig, model_path: str,
                            worker_addresses: dict[str, str]) -> None:
    """An embedding model's processes: its prefill workers, with no engine (each sees an embedding GGUF and serves
    embeddings only, prefill_cpu.worker.EmbeddingWorker), and no decode engine at all."""
    for name, address in worker_addresses.items():
        worker = worker_config(config, model_path, name, address, "", "f16", default_threads(config))
        supervisor.add(name, "prefill_cpu.worker", config_argv(worker))


def _child_config(cls: type[Config], config: ServeConfig, **own) -> Config:
    """The settings are copied by name: a knob both configs hold reaches the child without a line here."""
    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(config, f.name)}
    return check(cls(**{**shared, **own}))


@dataclass(frozen=True)
class Backoff:
    """When to restart a child that exited: quick failures in a row double the wait, a stable run resets it."""
    initial_s: float = 0.5
    max_s: float = 30.0
    stable_after_s: float = 60.0  # a child that ran this long was healthy: its next failure counts as the first
    crash_loop_after: int = 5  # this many quick failures in a row are reported as a crash loop
    start_attempts: int = 3  # a child that dies this many times before it was ever ready fails the start

    def delay_s(self, consecutive_failures: int) -> float:
        return min(self.max_s, self.initial_s * 2 ** max(0, consecutive_failures - 1))


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    state: str = "starting"  # starting | running | backoff | crash_loop | failed | stopped
    restarts: int = 0  # total over the gateway's life
    consecutive_failures: int = 0  # exits without a stable run in between; sets the backoff
    last_exit: int | None = None
    started_at: float | None = None
    next_start_at: float | None = None  # monotonic time of the scheduled restart, while waiting for it
    ready: bool = False  # the gateway has seen it ready at least once (Supervisor.is_ready)
    stderr: StderrTail | None = None  # the running process's stderr

    def snapshot(self) -> dict:
        """What /health shows for this process."""
        now = time.monotonic()
        alive = self.process is not None
        waiting = self.next_start_at is not None
        return {"state": self.state, "pid": self.process.pid if alive else None, "restarts": self.restarts,
                "consecutive_failures": self.consecutive_failures, "last_exit": self.last_exit,
                "next_start_in_s": round(max(0.0, self.next_start_at - now), 3) if waiting else None,
                "uptime_s": round(now - self.started_at, 3) if alive else None}


NEVER_READY_STOP_S = 1.0  # SIGTERM to SIGKILL for a child that was never ready: it holds no request


class Supervisor:
    def __init__(self, on_exit=None, backoff: Backoff = Backoff(), poll_interval_s: float = 0.25, is_ready=None,
                 on_start_failed=None, stop_timeout_s: float = 5.0) -> None:
        self.children: dict[str, Child] = {}
        self.on_exit = on_exit  # callback(name, returncode) so the gateway can fail that child's requests
        self.backoff = backoff
        self.poll_interval_s = poll_interval_s
        # is_ready(name) -> bool: whether the gateway has the child ready now. Without it no child is known to have
        # started, and every one is restarted however it dies.
        self.is_ready = is_ready
        self.on_start_failed = on_start_failed  # callback(reason) once a child's start has failed for good
        self.start_failure: str | None = None  # that reason
        self.stop_timeout_s = stop_timeout_s  # shutdown's SIGTERM to SIGKILL, unless it is given one
        self.stopping = False

    def add(self, name: str, module: str, args: list[str]) -> Child:
        """Start `python -m module *args` (through edge.launch.child_main) and keep it running."""
        if self.stopping:
            raise RuntimeError(f"not starting {name}: the supervisor is shutting down")
        child = Child(name, [sys.executable, "-m", "edge.launch.child_main", module, *args])
        self.children[name] = child
        self._start(child)
        return child

    def snapshot(self) -> dict[str, dict]:
        return {name: child.snapshot() for name, child in self.children.items()}

    def _start(self, child: Child) -> None:
        # Own process group: a terminal's Ctrl-C reaches only the gateway, which drains in-flight requests
        # (they need the children) before shutdown() stops the children; SIGKILL can then take the group.
        # Called on the event loop's thread: PR_SET_PDEATHSIG fires when the creating thread ends, not the process.
        child.process = subprocess.Popen(child.argv, env=child_environment(), process_group=0, stderr=subprocess.PIPE)
        child.stderr = StderrTail(child.process.stderr, child.name)
        child.started_at, child.next_start_at, child.state = time.monotonic(), None, "starting"
        log.info("started %s (pid %d)", child.name, child.process.pid)

    async def watch(self) -> None:
        """Restart children that exit; each child waits for its own backoff, so none delays the others."""
        while not self.stopping:
            for child in list(self.children.values()):
                self._tend(child, time.monotonic())
            await asyncio.sleep(self.poll_interval_s)

    def _tend(self, child: Child, now: float) -> None:
        if child.process is None:
            if child.next_start_at is not None and now >= child.next_start_at:
                self._restart(child, now)
            return
        code = child.process.poll()
        if now - child.started_at >= self.backoff.stable_after_s:
            child.consecutive_failures = 0  # it ran stably, even if it has just exited
        if code is None:
            child.state = "running"
            child.ready = child.ready or (self.is_ready is not None and bool(self.is_ready(child.name)))
            return
        if self.is_ready is not None and not child.ready \
                and child.consecutive_failures + 1 >= self.backoff.start_attempts:
            self._fail_start(child, code)
        else:
            self._schedule_restart(child, code, now)
        self._notify_exit(child.name, code)

    def _restart(self, child: Child, now: float) -> None:
        child.restarts += 1
        try:
            self._start(child)
        except OSError:  # e.g. out of memory or pids: retry later rather than stop watching every child
            log.exception("could not start %s", child.name)
            child.started_at = now
            self._schedule_restart(child, None, now)

    def _schedule_restart(self, child: Child, code: int | None, now: float) -> None:
        ran_s = now - child.started_at
        child.consecutive_failures += 1
        child.process = None
        if code is not None:  # None: the process could not be started, the last exit code still stands
            child.last_exit = code
        delay_s = self.backoff.delay_s(child.consecutive_failures)
        child.next_start_at = now + delay_s
        crash_loop = child.consecutive_failures >= self.backoff.crash_loop_after
        child.state = "crash_loop" if crash_loop else "backoff"
        log.error("%s exited with code %s after %.1f s (failure %d in a row%s); restarting in %.1f s",
                  child.name, code, ran_s, child.consecutive_failures, ", crash loop" if crash_loop else "", delay_s)

    def _fail_start(self, child: Child, code: int) -> None:
        """Not restarted again: it died at every start, so it would at the next (docs/security.md, "Model files")."""
        child.consecutive_failures += 1
        child.process, child.last_exit, child.state, child.next_start_at = None, code, "failed", None
        said = child.stderr.last_lines() if child.stderr else []
        reason = (f"{child.name} exited with {describe_exit(code)} during its start, {child.consecutive_failures} "
                  "times in a row, before it was ever ready")
        if said:
            reason += f"; its last words: {' | '.join(said)}"
        log.error("%s; not restarting it", reason)
        if self.start_failure is None:
            self.start_failure = reason
            if self.on_start_failed:
                try:
                    self.on_start_failed(reason)
                except Exception:
                    log.exception("on_start_failed callback failed")

    def _notify_exit(self, name: str, code: int) -> None:
        if self.on_exit:
            try:
                self.on_exit(name, code)
            except Exception:  # a failing callback must not end supervision of every child
                log.exception("on_exit callback failed for %s", name)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """SIGTERM to every child, SIGKILL to what has not exited after timeout_s (stop_timeout_s unless given), or
        after NEVER_READY_STOP_S for a child that was never ready (one stuck in a model load ignores SIGTERM)."""
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        self.stopping = True
        for child in self.children.values():
            child.next_start_at = None  # a child waiting for its backoff is not started any more
        live = [c for c in self.children.values() if c.process and c.process.poll() is None]
        for child in live:
            child.process.send_signal(signal.SIGTERM)
        began = time.monotonic()
        pending = list(live)
        while pending:
            waited = time.monotonic() - began
            done = [c for c in pending if c.process.poll() is not None or waited >= self._stop_wait(c, timeout_s)]
            for child in done:
                pending.remove(child)
                if child.process.poll() is None:
                    log.warning("%s did not stop in %.1f s; killing it", child.name, waited)
                    _kill_group(child.process)
            if pending:
                await asyncio.sleep(0.05)
        for child in self.children.values():
            child.process, child.state = None, "stopped"
        log.info("all child processes stopped")

    def _stop_wait(self, child: Child, timeout_s: float) -> float:
        never_ready = self.is_ready is not None and not child.ready
        return min(timeout_s, NEVER_READY_STOP_S) if never_ready else timeout_s


def describe_exit(code: int) -> str:
    """-6 -> "signal SIGABRT (an abort, e.g. an assertion in native code)"; 1 -> "exit code 1"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
    return f"signal {name}" + (" (an abort, e.g. an assertion in native code)" if name == "SIGABRT" else "")


def ready_probe(gateway):
    """is_ready for a Supervisor of this gateway's children: a worker is ready once its connection is (the pool's
    workers are named as the children are), the engine once the gateway's engine connection is."""
    def is_ready(name: str) -> bool:
        worker = gateway.pool.workers.get(name)
        if worker is not None:
            return worker.state == "ready"
        return gateway.engine.state == "ready"
    return is_ready


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the child and what it started in its process group (a hung child cannot stop its own)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the pid is not reused: the child is not reaped yet
    except ProcessLookupError:
        pass
    process.wait()
