"""Build the gateway application: launch (or connect to) the engine and workers, wire the routes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from pathlib import Path

from aiohttp import web
from aiohttp.web_runner import GracefulExit

from contracts import control_tls
from contracts.control_tls import ControlTLS
from contracts.events import FinishReason
from contracts.gguf_check import check_gguf
from contracts.identity import check_supported
from contracts.memory_plan import GATEWAY_RUNTIME, WORKER_RUNTIME, default_budgets
from contracts.messages import Recompute
from contracts.model_kind import model_kind
from contracts.tasks import spawn
from edge.api.structured import GrammarChecks
from edge.check_model.memory import machine, planned_config, serve_plan
from edge.config import ServeConfig, configured_models, model_config, policy_path
from edge.core import prefill_probe
from edge.core.engine_client import EngineClient
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.http.routes import add_routes
from edge.http.tls import warn_if_expiring
from edge.launch.launcher import Supervisor
from edge.launch.local import (
    connection_tasks,
    local_components,
    make_run_dir,
    ray_secret,
    remove_run_dir,
    resolve_addresses,
    start_processes,
)
from edge.models.registry import ModelRegistry
from edge.models.spec import ModelSpec
from edge.models.stack import ModelStack, ServedStack, SharedPriority
from edge.observe.audit import AuditLog, quota_state_path
from edge.state import CONFIG, GATEWAY, GRAMMAR_CHECKS, MODELS, RELOADER, SUPERVISOR
from policies.enforcer import PolicyEnforcer
from policies.loader import load_policy
from policies.quota import TokenQuotas
from policies.reloader import PolicyReloader
from prefill_cpu.embedded_model import embedded_model_path

log = logging.getLogger("edge.app")


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
        return _models_app(config)
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
        pool, engine, cluster_context = ray_components(config, registry, ray_secret(config), recompute)
        run_dir = None
    else:
        run_dir = make_run_dir(config)
        engine_address, worker_addresses = resolve_addresses(config, run_dir)
        pool, engine = local_components(config, registry, engine_address, worker_addresses, supervisor, recompute)
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
        app.on_cleanup.append(lambda _: remove_run_dir(run_dir))
    app.cleanup_ctx.append(_connections)
    app.cleanup_ctx.append(_policy_loop)
    app.on_startup.append(_graceful_sigterm)
    app.on_shutdown.append(_drain)
    app[GRAMMAR_CHECKS] = GrammarChecks()  # the gateway's structured-output compile processes, this app's own
    spec = dataclasses.replace(configured_models(config, model_path)[0], name=model_name)
    app[MODELS] = ModelRegistry.single(spec, ServedStack(gateway, supervisor))  # one model, loaded, pinned
    add_routes(app)
    return app


def _processes(model_path: str, engine_address: str, worker_addresses: dict[str, str], run_dir: str,
               embedding_only: bool = False):
    async def context(app: web.Application):
        watcher = start_processes(app[SUPERVISOR], app[CONFIG], model_path, engine_address, worker_addresses,
                                  run_dir, embedding_only, app[GRAMMAR_CHECKS])
        yield
        watcher.cancel()
        await app[SUPERVISOR].shutdown()
    return context


async def _connections(app: web.Application):
    gateway = app[GATEWAY]
    tasks = connection_tasks(gateway)
    yield
    gateway.engine.closing = gateway.pool.closing = True
    for task in tasks:
        task.cancel()


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


# --- several models ([[models]], issue 45): the app-wide parts as above, a registry of the models, each loaded as
# its own stack (edge.models.stack) on demand within the memory budget. The app's GATEWAY is then a front gateway
# with no processes of its own: what every model shares (the enforcer, the limits, shutting_down, the observers:
# quotas, audit, traces, the status board), answering what comes before a model is known; each model's gateway
# hands its requests' endings to it.

def _models_app(config: ServeConfig) -> web.Application:
    enforcer = _enforcer(config)
    enforcer.tiers.per_model = True  # each model's requests get the tier its own load puts it in
    audit, tracer = observers_of(config, enforcer)
    _control_tls(config)
    metrics = Metrics("")
    front = _front_gateway(config, enforcer, metrics)
    checks = GrammarChecks()
    registry = _models_registry(config, enforcer, checks, front)
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    _observe(front, app, audit, tracer)
    app[CONFIG], app[GATEWAY], app[MODELS], app[GRAMMAR_CHECKS] = config, front, registry, checks
    app[RELOADER] = PolicyReloader(policy_path(config), enforcer)
    app.cleanup_ctx.append(_models_running)
    app.cleanup_ctx.append(_policy_loop)
    app.on_startup.append(_graceful_sigterm)
    app.on_shutdown.append(_drain)
    add_routes(app)
    return app


def _front_gateway(config: ServeConfig, enforcer, metrics: Metrics) -> Gateway:
    """A gateway with no workers and no engine (never ready): the app-wide state every model's stack shares."""
    requests = InFlightRegistry()
    front = Gateway(config, "", PrefillPool({}, requests, config.limits.prefill_queue_size),
                    EngineClient("unix:", requests), requests, metrics, enforcer)
    front.observers.remove(front.slo.observe)  # each model's own SloControl hears its own requests
    return front


def _models_registry(config: ServeConfig, enforcer, checks: GrammarChecks,
                    front: Gateway) -> ModelRegistry:
    """The registry of config.models: each model planned with its own settings (contracts/memory_plan.py) against
    the one budget, less the gateway's own runtime, which every model's plan counts."""
    box = machine(config.device)
    planned: dict[str, ServeConfig] = {}
    priorities = SharedPriority()

    def cost(spec: ModelSpec) -> dict[str, int]:
        """Checked as `edge serve` checks its one model (ValueError: GGUFError, UnsupportedModelError, MemoryRefused
        when it cannot fit even alone), then planned."""
        check_gguf(spec.model)
        embedding = model_kind(spec.model).embedding
        if not embedding:
            check_supported(spec.model)
        own = model_config(config, spec)
        if embedding:  # its workers alone (edge serve plans no engine for it either): the workers' share
            planned[spec.name] = own
            return {"host": own.prefill_workers * (os.path.getsize(spec.model) + WORKER_RUNTIME)}
        plan = serve_plan(own, spec.model, box)
        planned[spec.name] = planned_config(own, plan, box)
        log.info("memory plan of %s:\n%s", spec.name, plan.describe())
        return {where: plan.used(where) - (GATEWAY_RUNTIME if where == "host" else 0) for where in plan.budgets}

    def make_stack(spec: ModelSpec) -> ModelStack:
        own = planned.get(spec.name) or model_config(config, spec)
        return ModelStack(own, enforcer, Metrics(spec.name), checks, front._notify, priorities)

    budgets = {where: budget - (GATEWAY_RUNTIME if where == "host" else 0)
               for where, budget in default_budgets(box, config.memory_budget).items()}
    registry = ModelRegistry(config.models, make_stack, cost, budgets, config.model_load_timeout_s)
    registry.priorities = priorities
    return registry


async def _models_running(app: web.Application):
    """The pinned models load as the server starts (in the background: the port answers meanwhile); every loaded
    model's stack stops at cleanup, after the drain."""
    registry = app[MODELS]
    task = spawn(registry.start(), "loading the pinned models", log)
    yield
    task.cancel()
    await registry.close()
