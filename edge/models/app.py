"""The app of a config with [[models]] (issue 45): the app-wide parts as edge.app makes them for one model (routes,
middleware, policy and its reloader, audit, traces, TLS), and a registry of the models, each loaded as its own
stack (edge.models.stack) on demand within the memory budget.

The app's GATEWAY is a front gateway with no processes of its own: it holds what every model shares (the policy
enforcer, the limits, shutting_down, the observers: quotas, audit, traces, the status board) and answers what comes
before a model is known. Each model's gateway hands its requests' endings to it (`forward`)."""

from __future__ import annotations

import logging
import os

from aiohttp import web

from contracts.gguf_check import check_gguf
from contracts.identity import check_supported
from contracts.memory_plan import GATEWAY_RUNTIME, WORKER_RUNTIME, default_budgets
from contracts.model_kind import model_kind
from contracts.tasks import spawn
from edge.api.structured import GrammarChecks
from edge.config import ServeConfig, model_config, policy_path
from edge.core.engine_client import EngineClient
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.models.registry import ModelRegistry
from edge.models.spec import ModelSpec
from edge.models.stack import ModelStack, SharedPriority
from edge.state import CONFIG, GATEWAY, GRAMMAR_CHECKS, MODELS, RELOADER
from policies.reloader import PolicyReloader

log = logging.getLogger("edge.models.app")


def make_models_app(config: ServeConfig) -> web.Application:
    from edge import app as single
    from edge.http.routes import add_routes
    enforcer = single._enforcer(config)
    audit, tracer = single.observers_of(config, enforcer)
    single._control_tls(config)
    metrics = Metrics("")
    front = front_gateway(config, enforcer, metrics)
    checks = GrammarChecks()
    registry = models_registry(config, enforcer, checks, front)
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    single._observe(front, app, audit, tracer)
    app[CONFIG], app[GATEWAY], app[MODELS], app[GRAMMAR_CHECKS] = config, front, registry, checks
    app[RELOADER] = PolicyReloader(policy_path(config), enforcer)
    app.cleanup_ctx.append(_models_running)
    app.cleanup_ctx.append(single._policy_loop)
    app.on_startup.append(single._graceful_sigterm)
    app.on_shutdown.append(single._drain)
    add_routes(app)
    return app


def front_gateway(config: ServeConfig, enforcer, metrics: Metrics) -> Gateway:
    """A gateway with no workers and no engine (never ready): the app-wide state every model's stack shares."""
    requests = InFlightRegistry()
    front = Gateway(config, "", PrefillPool({}, requests, config.limits.prefill_queue_size),
                    EngineClient("unix:", requests), requests, metrics, enforcer)
    front.observers.remove(front.slo.observe)  # each model's own SloControl hears its own requests
    return front


def models_registry(config: ServeConfig, enforcer, checks: GrammarChecks,
                    front: Gateway) -> ModelRegistry:
    """The registry of config.models: each model planned with its own settings (contracts/memory_plan.py) against
    the one budget, less the gateway's own runtime, which every model's plan counts."""
    from edge.check_model.memory import machine, planned_config, serve_plan
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


def loaded_gateways(app: web.Application) -> list[Gateway]:
    """The gateways of the loaded models (with [[models]]), else the app's one gateway."""
    registry = app.get(MODELS)
    if registry is None or not registry.several:
        return [app[GATEWAY]]
    return [stack.gateway for stack in registry.loaded()]

