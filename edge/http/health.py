"""GET /health, /v1/models (and one model's card) and /metrics: what the service is, and how it is."""

from __future__ import annotations

import dataclasses
import time

from aiohttp import web

from edge.api.fields import ApiError
from edge.core.gateway import Gateway
from edge.http.embeddings import model_facts
from edge.http.model_pick import loaded_gateways, several
from edge.http.models import model_card, model_list
from edge.observe.gauges import refresh_gauges
from edge.observe.process_memory import memory_report
from edge.state import GATEWAY, GRAMMAR_CHECKS, MODELS, RELOADER, SUPERVISOR


async def models(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY]
    if several(request.app):  # every configured model the key may use, with its state and memory
        try:
            return model_list(request)
        except ApiError as err:
            return err.response()
    try:
        gateway.check_key(request)
    except ApiError as err:
        return err.response()
    return web.json_response({"object": "list", "data": [_model_card(gateway.model_name, gateway)]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (the openai client's models.retrieve): the served model's card, else a 404."""
    gateway: Gateway = request.app[GATEWAY]
    name = request.match_info["model_id"]
    if several(request.app):
        try:
            return model_card(request)
        except ApiError as err:
            return err.response()
    try:
        gateway.check_key(request)
        gateway.check_model(name, request)
    except ApiError as err:
        return err.response()
    return web.json_response(_model_card(name, gateway))


def _model_card(name: str, gateway: Gateway) -> dict:
    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "edge"}
    return {**card, **model_facts(gateway)}


async def health(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY]
    if several(request.app):
        return _models_health(request)
    # each single engine by name (a down one of a group makes the service degraded); none for an embedding model
    components = {name: link.state for name, link in _engines(gateway).items()}
    components.update({name: w.state for name, w in gateway.pool.workers.items()})
    supervisor = request.app.get(SUPERVISOR)
    processes = supervisor.snapshot() if supervisor else {}
    ready = gateway.ready and not gateway.shutting_down
    troubled = any(p["state"] in ("backoff", "crash_loop") for p in processes.values())
    degraded = ready and (troubled or any(state != "ready" for state in components.values()))
    body = {"status": "degraded" if degraded else "ok" if ready else "loading" if not gateway.shutting_down
            else "shutting_down", "model": gateway.model_name, "components": components, "processes": processes,
            "errors": _component_errors(gateway), "prefill": _prefill_state(gateway),
            "prefill_queue": gateway.pool.queue_length, "policy": _policy_state(request),
            "engine": dataclasses.asdict(gateway.engine.stats) if gateway.engine.stats else None,
            "structured_outputs": request.app[GRAMMAR_CHECKS].state(), **model_facts(gateway),
            "memory": memory_report(request.app, supervisor)}  # each process's RSS and PSS against the memory plan
    if (engines := gateway.engine.describe()) is not None:
        body["engines"] = engines
    return web.json_response(body, status=200 if ready else 503)


def _engines(gateway: Gateway) -> dict:
    """The single decode engines by name (edge.core.engine_link); an embedding model is served without one."""
    return {} if gateway.embedding_only else gateway.engine.links()


def _component_errors(gateway: Gateway) -> dict:
    """Why a component is not ready (a refused handshake, a bad frame, a missed heartbeat), if known."""
    errors = {name: link.last_error for name, link in _engines(gateway).items()}
    errors.update({name: w.last_error for name, w in gateway.pool.workers.items()})
    return {name: error for name, error in errors.items() if error}


def _prefill_state(gateway: Gateway) -> dict:
    return {name: {"request": w.current_id, "stuck_count": w.stuck_count,
                   "engine_connected": w.engine_connected, "weights": w.info.prefill_weights if w.info else None,
                   # its prompt cache per tier: hits, misses, entries, bytes, max_bytes, evictions (returned: the
                   # answers' KV kept as hits, dropped as misses)
                   "cache_tiers": {t.name: {k: v for k, v in dataclasses.asdict(t).items() if k != "name"}
                                   for t in w.cache_tiers}}
            for name, w in gateway.pool.workers.items()}


def _policy_state(request: web.Request) -> dict:
    gateway: Gateway = request.app[GATEWAY]
    state = gateway.enforcer.evaluator.state
    reloader = request.app.get(RELOADER)
    return {"source": gateway.enforcer.policy.source, "tier": state.name, "reason": state.reason,
            "in_tier_s": round(gateway.enforcer.clock() - state.since, 1),
            "last_reload_error": reloader.last_error if reloader else None}


def _models_health(request: web.Request) -> web.Response:
    """With [[models]]: ok while no pinned model is missing and none failed; each model's state, memory, load and
    components (its processes, their errors, its engine's stats) under "models"."""
    front, registry = request.app[GATEWAY], request.app[MODELS]
    described = registry.describe()
    models = {}
    for entry in described:
        stack = registry.stack(entry["name"])
        models[entry["name"]] = {**entry, **(_model_health(stack) if stack is not None else {})}
    pinned_missing = [d["name"] for d in described if d["pinned"] and d["state"] != "loaded"]
    failed = [d["name"] for d in described if d["state"] == "failed"]
    status = ("shutting_down" if front.shutting_down else "loading" if pinned_missing and not failed
              else "degraded" if failed or pinned_missing else "ok")
    body = {"status": status, "models": models, "policy": _policy_state(request),
            "structured_outputs": request.app[GRAMMAR_CHECKS].state()}
    return web.json_response(body, status=200 if status in ("ok", "degraded") else 503)


def _model_health(stack) -> dict:
    gateway = stack.gateway
    components = {name: link.state for name, link in _engines(gateway).items()}
    components.update({name: w.state for name, w in gateway.pool.workers.items()})
    waiting, used, total = gateway.load()
    return {"ready": gateway.ready, "components": components, "processes": stack.supervisor.snapshot(),
            "errors": _component_errors(gateway), "prefill_queue": gateway.pool.queue_length,
            "load": {"waiting": waiting, "running": gateway.engine_stats.num_running, "kv_blocks_used": used,
                     "kv_blocks_total": total},
            "tier": gateway.enforcer.tier_state_of(gateway.model_name).name,  # its requests' (its own load's)
            "engine": dataclasses.asdict(gateway.engine.stats) if gateway.engine.stats else None,
            **model_facts(gateway)}


async def metrics(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY]
    served = loaded_gateways(request.app)  # with [[models]]: each loaded model's own series, by model_name
    for one in served:
        refresh_gauges(one)  # the values mirrored from the engines, the pool and the policy at each scrape
    others = [one.metrics for one in served if one is not gateway]
    return web.Response(body=gateway.metrics.render(*others), headers={"Content-Type": "text/plain; version=0.0.4"})
