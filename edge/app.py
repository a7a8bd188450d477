"""Build the gateway application: launch (or connect to) the engine and workers, wire the routes."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil
from aiohttp import web
from aiohttp.web_runner import GracefulExit

from contracts import control_tls
from contracts.control_tls import ControlTLS
from contracts.events import FinishReason
from contracts.framing import SECRET_ENV, control_secret, new_secret, refuse_plaintext_links
from contracts.messages import Recompute
from contracts.model_kind import model_kind
from contracts.process_config import config_argv
from contracts.startup_clock import since_start
from contracts.tasks import spawn
from edge.api.structured import GrammarChecks
from edge.config import ServeConfig, configured_models, default_threads, policy_path, worker_kv_type
from edge.core import prefill_probe
from edge.core.engine_client import EngineClient
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.http.routes import add_routes
from edge.http.tls import warn_if_expiring
from edge.launch.launcher import Supervisor, engine_config, start_embedding_workers, worker_config
from edge.models.registry import ModelRegistry
from edge.models.stack import ServedStack
from edge.observe.audit import AuditLog, quota_state_path
from edge.state import CONFIG, GATEWAY, GRAMMAR_CHECKS, MODELS, RELOADER, SUPERVISOR
from policies.enforcer import PolicyEnforcer
from policies.loader import load_policy
from policies.quota import TokenQuotas
from policies.reloader import PolicyReloader
from prefill_cpu.embedded_model import embedded_model_path

log = logging.getLogger("edge.app")
READY_POLL_S = 0.1  # how often the start-up looks whether /health answers 200 yet, to log when it does
RUN_DIR_PREFIX = "edge-"
OWNER_FILE = "gateway.pid"  # in a temporary run dir: "<pid> <process start time>" of the gateway that made it


def resolve_addresses(config: ServeConfig, run_dir: str) -> tuple[str, dict[str, str]]:
    engine = config.engine_address or f"unix:{os.path.join(run_dir, 'engine.sock')}"
    workers = list(config.worker_addresses) or [f"unix:{os.path.join(run_dir, f'prefill-{i}.sock')}"
                                                for i in range(config.prefill_workers)]
    return engine, {f"prefill-{i}": address for i, address in enumerate(workers)}


def _make_run_dir(config: ServeConfig) -> str:
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


def _kill_stuck(supervisor: Supervisor | None, name: str) -> bool:
    """A stuck worker is killed (SIGKILL works on a stopped process too) and restarted by the supervisor; a worker
    this gateway did not launch (launch = false) cannot be."""
    child = supervisor.children.get(name) if supervisor is not None else None
    if child is None or child.process is None or child.process.poll() is not None:
        return False
    log.error("killing stuck %s (pid %d); the supervisor restarts it", name, child.process.pid)
    child.process.kill()
    return True


async def _remove_run_dir(run_dir: str) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)


def _control_secret(config: ServeConfig, addresses: list[str]) -> bytes:
    """One shared secret for every control connection: the operator's file (required for TCP peers), or one
    made for this launch; the children inherit it through the environment."""
    if config.control_secret_file:
        os.environ[SECRET_ENV] = _read_secret_file(config.control_secret_file)
    elif config.launch and not os.environ.get(SECRET_ENV):
        os.environ[SECRET_ENV] = new_secret()
    for address in addresses:
        control_secret(address)  # TCP without a secret: refused here, with the reason
    refuse_plaintext_links(addresses)  # plain TCP off loopback without allow_plaintext_control, too
    return os.environ.get(SECRET_ENV, "").encode()


def _ray_secret(config: ServeConfig) -> str:
    """The control secret of a Ray deployment: the operator's file, or one made for this launch. It reaches the
    actors as an argument (through Ray), never through a port."""
    return _read_secret_file(config.control_secret_file) if config.control_secret_file else new_secret()


def _read_secret_file(path: str) -> str:
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


def _control_tls(config: ServeConfig) -> ControlTLS:
    """This process's control TLS (every file checked now), handed to the children in their configs. Ray's actors
    listen on their nodes' addresses: without TLS that takes allow_plaintext_control."""
    tls = control_tls.configure(ControlTLS.of(config))
    if tls.on:
        warn_if_expiring(tls.certfile, "control_tls_certfile")
    elif config.ray and not tls.allow_plaintext:
        raise ValueError("ray: the actors' control links cross the network in clear, readable and forgeable on the "
                         "way; give control_tls_certfile, control_tls_keyfile and control_tls_ca (docs/security.md), "
                         "or set allow_plaintext_control = true on a network you trust")
    return tls


def _enforcer(config: ServeConfig) -> PolicyEnforcer:
    policy = load_policy(policy_path(config))
    if not config.audit_log and any(rule.tokens_per_day or rule.tokens_per_month for rule in policy.keys.values()):
        log.warning("token quotas are counted in memory only: a restart starts them at zero (set audit_log to "
                    "keep them next to it)")
    quotas = TokenQuotas(quota_state_path(config.audit_log))  # a bad state file: ValueError, edge serve stops
    return PolicyEnforcer(policy, config.limits.default_max_tokens, quotas=quotas)


def _observe(gateway: Gateway, app: web.Application, audit: AuditLog | None, tracer) -> None:
    """Every request's ending counts against its key's quotas and, when configured, goes to the audit log and
    becomes a trace."""
    gateway.observers.append(gateway.enforcer.count_tokens)
    closing = [observer for observer in (audit, tracer) if observer is not None]
    gateway.observers.extend(closing)

    async def close(_: web.Application) -> None:
        for observer in closing:
            observer.close()
    app.on_cleanup.append(close)  # after the drain: the last requests' lines and spans are written


def observers_of(config: ServeConfig, enforcer: PolicyEnforcer) -> tuple[AuditLog | None, object]:
    """The audit log and the tracer, when configured."""
    audit = (AuditLog(config.audit_log, config.audit_log_max_bytes, config.audit_log_backups, enforcer,
                      config.audit_log_keep_days) if config.audit_log else None)
    tracer = None
    if config.otlp_traces_endpoint:  # OpenTelemetry is imported only then (an optional dependency)
        from edge.observe.tracing import RequestTracer
        tracer = RequestTracer(config.otlp_traces_endpoint)
    return audit, tracer


def make_app(config: ServeConfig) -> web.Application:
    if config.models:  # several models, each loaded on demand (issue 45)
        from edge.models.app import make_models_app
        return make_models_app(config)
    model_path = config.model or embedded_model_path()
    model_name = config.model_name or Path(model_path).name.removesuffix(".gguf")
    enforcer = _enforcer(config)  # these two before the run dir: a refusal here leaves nothing behind
    audit, tracer = observers_of(config, enforcer)
    registry = InFlightRegistry()
    _control_tls(config)
    kind = model_kind(model_path) if os.path.isfile(model_path) else None
    embedding_only = kind is not None and kind.embedding
    if embedding_only and config.ray:
        raise ValueError(f"ray: {model_name} is an embedding model ({kind.reason}), served by its prefill workers "
                         "alone; serve it without ray")
    gateway: Gateway | None = None  # made below, once the pool and engine it drives are

    def recompute(ask: Recompute, client: EngineClient) -> None:
        """An engine preempted a choice by recompute (called on the loop, once the connections run)."""
        gateway.recompute(ask, client)

    supervisor = Supervisor() if config.launch and not config.ray else None
    if config.ray:  # Ray is imported only here: single-box mode never loads it
        from edge.launch.ray_gateway_side import ray_components
        pool, engine, cluster_context = ray_components(config, registry, _ray_secret(config), recompute)
        run_dir = None
    else:
        run_dir = _make_run_dir(config)
        engine_address, worker_addresses = resolve_addresses(config, run_dir)
        pool, engine = _local_components(config, registry, engine_address, worker_addresses, supervisor, recompute)
    gateway = Gateway(config, model_name, pool, engine, registry, Metrics(model_name), enforcer)
    gateway.embedding_only = embedding_only
    gateway.probe_pending = not embedding_only and prefill_probe.wanted(enforcer.policy)  # a TTFT promised
    if embedding_only:
        log.info("%s is an embedding model (%s, %s pooling): prefill workers only, no decode engine; generation "
                 "routes answer 400", model_name, kind.reason, kind.pooling)
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    _observe(gateway, app, audit, tracer)
    app[CONFIG] = config
    app[GATEWAY] = gateway
    app[RELOADER] = PolicyReloader(policy_path(config), enforcer)
    if config.ray:
        app.cleanup_ctx.append(cluster_context)
    elif supervisor is not None:
        app[SUPERVISOR] = supervisor
        app.cleanup_ctx.append(_processes(model_path, engine_address, worker_addresses, run_dir, embedding_only))
    if run_dir is not None and not config.run_dir:
        app.on_cleanup.append(lambda _: _remove_run_dir(run_dir))
    app.cleanup_ctx.append(_connections)
    app.cleanup_ctx.append(_policy_loop)
    app.on_startup.append(_graceful_sigterm)
    app.on_shutdown.append(_drain)
    app[GRAMMAR_CHECKS] = GrammarChecks()  # the gateway's structured-output compile processes, this app's own
    spec = dataclasses.replace(configured_models(config, model_path)[0], name=model_name)
    app[MODELS] = ModelRegistry.single(spec, ServedStack(gateway, supervisor))  # one model, loaded, pinned
    add_routes(app)
    return app


def _local_components(config: ServeConfig, registry: InFlightRegistry, engine_address: str,
                      worker_addresses: dict[str, str], supervisor: Supervisor | None,
                      recompute: Callable[[Recompute, EngineClient], None]) -> tuple[PrefillPool, EngineClient]:
    """The prefill pool and the engine connection of single-box mode (a stuck worker is killed by the supervisor,
    when this gateway launched it)."""
    secret = _control_secret(config, [engine_address, *worker_addresses.values()])
    engine = EngineClient(engine_address, registry, secret, heartbeat_timeout_s=config.engine_heartbeat_timeout_s,
                          on_recompute=recompute)
    pool = PrefillPool(worker_addresses, registry, config.limits.prefill_queue_size, secret,
                       config.worker_heartbeat_timeout_s, on_best_priority=engine.prefill_priority_changed,
                       on_backlog=engine.prefill_backlog_changed, choose_engine=engine.choose,
                       on_stuck=functools.partial(_kill_stuck, supervisor))
    return pool, engine


def _processes(model_path: str, engine_address: str, worker_addresses: dict[str, str], run_dir: str,
               embedding_only: bool = False):
    async def context(app: web.Application):
        watcher = start_processes(app[SUPERVISOR], app[CONFIG], model_path, engine_address, worker_addresses,
                                  run_dir, embedding_only, app[GRAMMAR_CHECKS])
        yield
        watcher.cancel()
        await app[SUPERVISOR].shutdown()
    return context


def start_processes(supervisor, config: ServeConfig, model_path: str, engine_address: str,
                    worker_addresses: dict[str, str], run_dir: str, embedding_only: bool,
                    grammar_checks: GrammarChecks) -> asyncio.Task:
    """One model's engine and workers launched (its workers alone for an embedding model); the task that watches
    them (cancel it after supervisor.shutdown())."""
    if embedding_only:  # the workers alone: no engine, no handoff, no structured outputs
        start_embedding_workers(supervisor, config, model_path, worker_addresses)
    else:
        _add_engine_and_workers(supervisor, config, model_path, engine_address, worker_addresses, run_dir)
    watcher = spawn(supervisor.watch(), "the process supervisor", log)
    if not embedding_only:
        grammar_checks.warm(model_path)  # the gateway's compile processes load the vocabulary meanwhile
    return watcher


def _add_engine_and_workers(supervisor, config: ServeConfig, model_path: str, engine_address: str,
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


async def _connections(app: web.Application):
    gateway = app[GATEWAY]
    tasks = connection_tasks(gateway)
    yield
    gateway.engine.closing = gateway.pool.closing = True
    for task in tasks:
        task.cancel()


def connection_tasks(gateway: Gateway, announce: bool = True) -> list[asyncio.Task]:
    """One model's connections to its workers and engine, its start-up probe, and (announce) the ready line."""
    tasks = [spawn(gateway.pool.run(), "the prefill worker connections", log)]
    if not gateway.embedding_only:  # an embedding model has no engine to connect to
        tasks.append(spawn(gateway.engine.run(), "the decode engine connection", log))
    if gateway.probe_pending:  # ready once the prefill line is known (a record, or measured now; bounded)
        tasks.append(spawn(prefill_probe.measure_at_start(gateway), "the prefill line's start-up probe", log))
    if announce:
        tasks.append(spawn(_announce_ready(gateway), "the readiness announcement", log))
    return tasks


async def _announce_ready(gateway: Gateway, poll_s: float = READY_POLL_S) -> None:
    """Log once when /health first answers 200: the one line that says how long `edge serve` took to start."""
    while not gateway.ready:
        await asyncio.sleep(poll_s)
    engine = "" if gateway.embedding_only else "the decode engine and "
    log.info("ready: %s%d of %d prefill workers connected, %.1f s after the gateway process started", engine,
             gateway.pool.num_ready, len(gateway.pool.workers), since_start())


async def _policy_loop(app: web.Application):
    """Feed load signals to the tier evaluator twice a second; reload the policy file on change or SIGHUP."""
    gateway, reloader = app[GATEWAY], app[RELOADER]
    loop = asyncio.get_running_loop()

    def reload_now() -> None:
        if reloader.reload() is False:
            gateway.metrics.label(gateway.metrics.policy_reload_failures).inc()
    loop.add_signal_handler(signal.SIGHUP, reload_now)

    async def run() -> None:
        ticks = 0
        while True:
            await asyncio.sleep(0.5)
            ticks += 1
            try:
                gateway.update_policy_signals(_other_models(app))
                if ticks % 2 == 0 and reloader.poll() is False:
                    gateway.metrics.label(gateway.metrics.policy_reload_failures).inc()
            except Exception:  # one bad tick (a psutil hiccup) must not end load-based degradation for good
                log.exception("policy tick failed; the next one tries again")
    task = spawn(run(), "the policy loop", log)
    yield
    task.cancel()
    loop.remove_signal_handler(signal.SIGHUP)


def _other_models(app: web.Application) -> tuple[Gateway, ...]:
    """With [[models]]: the loaded models' gateways, whose load the tiers see beside the app's front gateway."""
    registry = app.get(MODELS)
    return tuple(stack.gateway for stack in registry.loaded()) if registry is not None and registry.several else ()


async def _graceful_sigterm(app: web.Application) -> None:
    """aiohttp's own SIGTERM handler closes every keep-alive connection at once, so a request sent on one
    just then is dropped unanswered. Instead: refuse new requests with 503 shutting_down (and Connection:
    close) for a short while, then let aiohttp stop as usual (the drain below still applies)."""
    gateway, loop = app[GATEWAY], asyncio.get_running_loop()
    linger_s = min(1.0, app[CONFIG].limits.shutdown_grace_s)

    def on_sigterm() -> None:
        if not gateway.shutting_down:
            gateway.shutting_down = True
            log.info("SIGTERM: new requests get 503 for %.1f s, then the server stops", linger_s)
            loop.call_later(linger_s, _raise_graceful_exit)
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)


def _raise_graceful_exit() -> None:
    raise GracefulExit()  # what aiohttp's handler raises: run_app then runs its shutdown sequence


async def _drain(app: web.Application) -> None:
    """Runs once the listener is closed: in-flight requests get a grace period to finish, then the rest
    end with an explicit abort in their stream (aiohttp waits for their handlers before cleanup)."""
    gateways = (app[GATEWAY], *_other_models(app))
    for gateway in gateways:
        gateway.shutting_down = True
    app[GRAMMAR_CHECKS].close()  # a compile never holds the exit: its request ends now with a 503
    grace_s = app[CONFIG].limits.shutdown_grace_s
    log.info("shutting down: %d requests in flight, %.0f s to finish",
             sum(len(g.registry.requests) for g in gateways), grace_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while any(g.registry.requests for g in gateways) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for gateway in gateways:
        for request_id in list(gateway.registry.requests):
            gateway.registry.deliver_ending(request_id, FinishReason.ABORT)
