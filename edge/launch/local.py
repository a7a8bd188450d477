"""One model's processes on this box, as `edge serve` launches them (edge.app for the single model, edge.models.stack
for each model of [[models]]): its private run dir and the addresses in it, the control secret, the prefill pool and
engine connection, the engine and workers started under a supervisor, and the connection tasks."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil

from contracts.framing import SECRET_ENV, control_secret, new_secret, refuse_plaintext_links
from contracts.messages import Recompute
from contracts.process_config import config_argv
from contracts.startup_clock import since_start
from contracts.tasks import spawn
from edge.api.structured import GrammarChecks
from edge.config import ServeConfig, default_threads, worker_kv_type
from edge.core import prefill_probe
from edge.core.engine_client import EngineClient
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.prefill_pool import PrefillPool
from edge.launch.launcher import Supervisor, engine_config, start_embedding_workers, worker_config

log = logging.getLogger("edge.launch.local")
READY_POLL_S = 0.1  # how often the start-up looks whether /health answers 200 yet, to log when it does
RUN_DIR_PREFIX = "edge-"
OWNER_FILE = "gateway.pid"  # in a temporary run dir: "<pid> <process start time>" of the gateway that made it

def resolve_addresses(config: ServeConfig, run_dir: str) -> tuple[str, dict[str, str]]:
    engine = config.engine_address or f"unix:{os.path.join(run_dir, 'engine.sock')}"
    workers = list(config.worker_addresses) or [f"unix:{os.path.join(run_dir, f'prefill-{i}.sock')}"
                                                for i in range(config.prefill_workers)]
    return engine, {f"prefill-{i}": address for i, address in enumerate(workers)}


def make_run_dir(config: ServeConfig) -> str:
    """Where local sockets live: private to this user (0700), a fresh temporary one unless configured. A temporary
    one names its gateway (OWNER_FILE) so that the next start can remove it if that gateway was killed before its
    cleanup ran."""
    if not config.run_dir:
        remove_stale_run_dirs(tempfile.gettempdir())
        run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)  # created 0700
        me = psutil.Process()
        Path(run_dir, OWNER_FILE).write_text(f"{me.pid} {me.create_time()}\n")
        return run_dir
    Path(config.run_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(config.run_dir, 0o700)
    return config.run_dir


def remove_stale_run_dirs(parent: str) -> list[str]:
    """Remove the temporary run dirs (this user's) whose gateway is gone: killed (SIGKILL, OOM) before it could
    remove its own. A dir without an owner file, or whose owner still runs, is left alone. Returns those removed."""
    removed = []
    for path in Path(parent).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            pid, started = (path / OWNER_FILE).read_text().split()
        except (OSError, ValueError):  # not ours, gone meanwhile, or no owner file (not made by a gateway)
            continue
        if not _running(int(pid), float(started)):
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed the run dir %s of a gateway that is gone (pid %s)", path, pid)
            removed.append(str(path))
    return removed


def _running(pid: int, started: float) -> bool:
    """Whether that process still runs: the pid alone may be another process's by now."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process (access denied): it exists
        return True


def kill_stuck(supervisor: Supervisor | None, name: str) -> bool:
    """A stuck worker is killed (SIGKILL works on a stopped process too) and restarted by the supervisor; a worker
    this gateway did not launch (launch = false) cannot be."""
    child = supervisor.children.get(name) if supervisor is not None else None
    if child is None or child.process is None or child.process.poll() is not None:
        return False
    log.error("killing stuck %s (pid %d); the supervisor restarts it", name, child.process.pid)
    child.process.kill()
    return True


async def remove_run_dir(run_dir: str) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)


def launch_secret(config: ServeConfig, addresses: list[str]) -> bytes:
    """One shared secret for every control connection: the operator's file (required for TCP peers), or one
    made for this launch; the children inherit it through the environment."""
    if config.control_secret_file:
        os.environ[SECRET_ENV] = read_secret_file(config.control_secret_file)
    elif config.launch and not os.environ.get(SECRET_ENV):
        os.environ[SECRET_ENV] = new_secret()
    for address in addresses:
        control_secret(address)  # TCP without a secret: refused here, with the reason
    refuse_plaintext_links(addresses)  # plain TCP off loopback without allow_plaintext_control, too
    return os.environ.get(SECRET_ENV, "").encode()


def ray_secret(config: ServeConfig) -> str:
    """The control secret of a Ray deployment: the operator's file, or one made for this launch. It reaches the
    actors as an argument (through Ray), never through a port."""
    return read_secret_file(config.control_secret_file) if config.control_secret_file else new_secret()


def read_secret_file(path: str) -> str:
    """The secret in the operator's file. Anyone who can read it can join the control plane: a file every user
    may open is refused; one its group may read is taken with a warning (container platforms hand a service its
    secrets that way, e.g. Kubernetes' fsGroup; docs/security.md)."""
    try:
        mode = os.stat(path).st_mode
        value = Path(path).read_text().strip()
    except OSError as err:
        raise ValueError(f"control_secret_file {path}: {err.strerror}") from None
    if mode & 0o007:
        raise ValueError(f"control_secret_file {path}: every user of this host may open it (mode {mode & 0o777:o}), "
                         f"and whoever reads it can join the control plane: chmod 600 it (or 640 for a group)")
    if len(value) < 16:
        raise ValueError(f"control_secret_file {path}: the secret is shorter than 16 characters")
    if mode & 0o070:
        log.warning("control_secret_file %s can be read by its group (mode %o): every member can join the control "
                    "plane; chmod 600 it unless the group is this service's alone", path, mode & 0o777)
    return value


def local_components(config: ServeConfig, registry: InFlightRegistry, engine_address: str,
                      worker_addresses: dict[str, str], supervisor: Supervisor | None,
                      recompute: Callable[[Recompute, EngineClient], None]) -> tuple[PrefillPool, EngineClient]:
    """The prefill pool and the engine connection of single-box mode (a stuck worker is killed by the supervisor,
    when this gateway launched it)."""
    secret = launch_secret(config, [engine_address, *worker_addresses.values()])
    engine = EngineClient(engine_address, registry, secret, heartbeat_timeout_s=config.engine_heartbeat_timeout_s,
                          on_recompute=recompute)
    pool = PrefillPool(worker_addresses, registry, config.limits.prefill_queue_size, secret,
                       config.worker_heartbeat_timeout_s, on_best_priority=engine.prefill_priority_changed,
                       on_backlog=engine.prefill_backlog_changed, choose_engine=engine.choose,
                       on_stuck=functools.partial(kill_stuck, supervisor))
    return pool, engine


def start_processes(supervisor, config: ServeConfig, model_path: str, engine_address: str,
                    worker_addresses: dict[str, str], run_dir: str, embedding_only: bool,
                    grammar_checks: GrammarChecks) -> asyncio.Task:
    """One model's engine and workers launched (its workers alone for an embedding model); the task that watches
    them (cancel it after supervisor.shutdown())."""
    if embedding_only:  # the workers alone: no engine, no handoff, no structured outputs
        start_embedding_workers(supervisor, config, model_path, worker_addresses)
    else:
        add_engine_and_workers(supervisor, config, model_path, engine_address, worker_addresses, run_dir)
    watcher = spawn(supervisor.watch(), "the process supervisor", log)
    if not embedding_only:
        grammar_checks.warm(model_path)  # the gateway's compile processes load the vocabulary meanwhile
    return watcher


def add_engine_and_workers(supervisor, config: ServeConfig, model_path: str, engine_address: str,
                            worker_addresses: dict[str, str], run_dir: str) -> None:
    # an engine decoding on the CPU tells the workers launched here when it decodes: they share the cores
    share = os.path.join(run_dir, "cpu-share")
    engine = engine_config(config, model_path, engine_address, share)
    supervisor.add("decode_engine", "decode_gpu.service.server", config_argv(engine))
    if config.cpu_decode_pace_ms and default_threads(config) > 1:
        log.warning("cpu_decode_pace_ms = %g with %d threads a prefill worker: a worker that shares the cores "
                    "with decode runs half its threads while decode has sequences, so the cores idle while decode "
                    "waits out its pace; pacing pays with threads_per_worker = 1 and a worker per core "
                    "(docs/config.md)", config.cpu_decode_pace_ms, default_threads(config))
    kv_type = worker_kv_type(config, engine_address)
    log.info("prefill workers hand their KV over as %s (kv_type %s, engine at %s)", kv_type, config.kv_type,
             engine_address)
    for name, address in worker_addresses.items():
        worker = worker_config(config, model_path, name, address, engine_address, kv_type, default_threads(config),
                               share)
        supervisor.add(name, "prefill_cpu.worker", config_argv(worker))


def connection_tasks(gateway: Gateway, announce: bool = True) -> list[asyncio.Task]:
    """One model's connections to its workers and engine, its start-up probe, and (announce) the ready line."""
    tasks = [spawn(gateway.pool.run(), "the prefill worker connections", log)]
    if not gateway.embedding_only:  # an embedding model has no engine to connect to
        tasks.append(spawn(gateway.engine.run(), "the decode engine connection", log))
    if gateway.probe_pending:  # ready once the prefill line is known (a record, or measured now; bounded)
        tasks.append(spawn(prefill_probe.measure_at_start(gateway), "the prefill line's start-up probe", log))
    if announce:
        tasks.append(spawn(announce_ready(gateway), "the readiness announcement", log))
    return tasks


async def announce_ready(gateway: Gateway, poll_s: float = READY_POLL_S) -> None:
    """Log once when /health first answers 200: the one line that says how long `edge serve` took to start."""
    while not gateway.ready:
        await asyncio.sleep(poll_s)
    engine = "" if gateway.embedding_only else "the decode engine and "
    log.info("ready: %s%d of %d prefill workers connected, %.1f s after the gateway process started", engine,
             gateway.pool.num_ready, len(gateway.pool.workers), since_start())
