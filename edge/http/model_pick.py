"""Which model's stack answers a request (issue 45): the body's `model` (a path's or query's for GET routes), checked
against what the key may use (else 404 model_not_found, the body an unknown model gets: no existence leak), loaded
first if it is not (the wait is in the request's TTFT), held until the answer is out (edge.models.registry).

A handler reads its gateway with gateway_of(request): the chosen model's with [[models]], the app's one otherwise
(a single-model app is served exactly as before: nothing here runs for it)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from edge.api.errors import model_not_found, policy_error
from edge.api.fields import ApiError
from edge.core.gateway import LOAD_WAIT, Gateway
from edge.core.run import bearer_key, tenant_of
from edge.http.body import BODY, read_json
from edge.models.spec import keep_alive_seconds
from edge.state import GATEWAY, MODELS
from policies.enforcer import PolicyRejection

log = logging.getLogger("edge.http.model_pick")
CHOSEN = web.RequestKey("model_gateway", Gateway)  # request key: the gateway of the model the request named


def gateway_of(request: web.Request) -> Gateway:
    return request.get(CHOSEN) or request.app[GATEWAY]


def several(app: web.Application) -> bool:
    registry = app.get(MODELS)
    return registry is not None and registry.several


def loaded_gateways(app: web.Application) -> list[Gateway]:
    """The gateways of the loaded models (with [[models]]), else the app's one gateway."""
    if not several(app):
        return [app[GATEWAY]]
    return [stack.gateway for stack in app[MODELS].loaded()]


def visible_models(request: web.Request) -> list[str]:
    """The configured models this request's key may use, in the config's order."""
    front, registry = request.app[GATEWAY], request.app[MODELS]
    served = set(registry.names)
    allowed = front.enforcer.models_for(bearer_key(request), tenant_of(request, front.enforcer.policy), served)
    return [name for name in registry.names if name in allowed]


def check_visible(request: web.Request, name) -> str:
    """The model's name if this key may use it; else the 404 an unknown model gets."""
    available = visible_models(request)
    if not isinstance(name, str) or name not in available:
        raise model_not_found(name if isinstance(name, str) else str(name), available)
    return name


@contextlib.asynccontextmanager
async def use_model(request: web.Request, name, keep_alive=None, priority: int | None = None
                    ) -> AsyncIterator[Gateway]:
    """The named model's gateway, loaded if it was not, held (never evicted or unloaded for idleness) until the
    block ends; then its keep_alive (the request's own, if it gave one) starts. Raises ApiError: 404 for a model the
    key may not use, 400 for a bad keep_alive, 429 when a limit of the key's would refuse it anyway and the model is
    not loaded, 503 when it cannot be loaded (registry.acquire)."""
    front, registry = request.app[GATEWAY], request.app[MODELS]
    if front.shutting_down:
        raise ApiError(503, "the server is shutting down", error_type="server_error", code="shutting_down",
                       headers={"Connection": "close", "Retry-After": "5"})
    front.check_key(request)
    name = check_visible(request, name)
    keep_alive_s = None
    if keep_alive is not None:
        try:
            keep_alive_s = keep_alive_seconds(keep_alive)
        except ValueError as err:
            raise ApiError(400, f"'keep_alive': {err}", "keep_alive", "invalid_value") from None
    key, tenant = bearer_key(request), tenant_of(request, front.enforcer.policy)
    if registry.stack(name) is None:  # a request its limits refuse makes no model load (nor another be evicted)
        try:
            front.enforcer.check_room(key, tenant, name)
        except PolicyRejection as err:
            raise policy_error(err) from None
    if priority is None:
        priority = front.enforcer.priority_for(key, tenant)
    began = time.perf_counter()
    stack = await registry.acquire(name, priority, keep_alive_s)
    waited = time.perf_counter() - began
    if waited > 0.05:
        request[LOAD_WAIT] = waited  # Gateway.admit counts it in the request's TTFT
        log.info("a request for %s waited %.2f s for its load", name, waited)
    try:
        yield stack.gateway
    finally:
        registry.release(name)


def per_model(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """A POST route whose body names its model: with [[models]], that model's gateway is chosen (gateway_of) and
    held while the handler answers; a single-model app calls the handler as it is."""
    async def route(request: web.Request) -> web.StreamResponse:
        if not several(request.app):
            return await handler(request)
        front = request.app[GATEWAY]
        try:
            front.check_key(request)
            body = await read_json(request, front)
            request[BODY] = body
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object that names its model", code="invalid_type")
            if "model" not in body:
                raise ApiError(400, f"'model' is required: this server serves several models "
                                    f"({', '.join(visible_models(request)) or 'none for this key'})", "model",
                               "missing_required_parameter")
            async with use_model(request, body["model"], body.get("keep_alive"), _priority(body)) as gateway:
                request[CHOSEN] = gateway
                return await handler(request)
        except ApiError as err:
            if CHOSEN not in request:  # refused before its model's handler ran: the front counts it
                front.metrics.label(front.metrics.rejected, reason=err.code or str(err.status)).inc()
                front.rejected(request, err, None)
            raise  # the error middleware answers it in the route's shape (Anthropic's under /v1/messages)
    route.__name__ = getattr(handler, "__name__", "route")
    return route


def _priority(body: dict) -> int | None:
    """A request's own priority (vLLM's field) orders its wait for a load; else its class's (use_model)."""
    value = body.get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
