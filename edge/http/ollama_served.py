"""The configured models as Ollama's routes (edge.http.ollama, edge.http.ollama_embed) see them, and what every one
of those routes does before its model's handler: `models`, the one place they learn which models exist, their state
and gateway (edge.models.registry); a client's name resolved (ours, or with Ollama's ':latest'); what the key may
see; the model held for the request (loaded on demand with several models, edge.http.model_pick); keep_alive
checked; a refusal counted as every route counts one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from edge.api.errors import model_not_found
from edge.api.fields import ApiError, checked_text
from edge.api.generate_request import GenerateRequest
from edge.api.ollama import error_response
from edge.config import keep_alive_seconds  # edge.models.spec's, as the config reads [[models]] keep_alive
from edge.core.gateway import Gateway
from edge.http.body import BODY, read_json
from edge.http.model_file import model_path
from edge.http.model_pick import CHOSEN, several, use_model, visible_models
from edge.state import GATEWAY, MODELS


@dataclass(frozen=True)
class Configured:
    """A configured model as /api/tags, /api/ps and /api/show see it."""
    name: str
    path: str | None  # its GGUF (None: a server that does not know its file)
    gateway: Gateway | None  # while it is loaded
    state: str  # loaded, loading, unloaded, unloading, failed (edge.models.registry)
    memory: dict | None  # {"rss", "pss"} its processes hold while loaded
    expires_at: float | None  # the Unix time its keep_alive unloads it; None: never
    pinned: bool = True


def models(app: web.Application) -> dict[str, Configured]:
    """Every configured model by its served name: the one place the routes learn which models exist, their state
    and their gateway (edge.models.registry; an app built without one serves its GATEWAY's model)."""
    registry = app.get(MODELS)
    if registry is None:
        gateway = app[GATEWAY]
        return {gateway.model_name: Configured(gateway.model_name, model_path(gateway), gateway, "loaded", None, None)}
    out = {}
    for described in registry.describe():
        stack = registry.stack(described["name"])
        gateway = stack.gateway if stack is not None else None
        path = model_path(gateway) if gateway is not None else described["model"] or _embedded_path()
        out[described["name"]] = Configured(described["name"], path, gateway, described["state"],
                                            described["memory"]["measured"], described["expires_at"],
                                            described["pinned"])
    return out


def served(app: web.Application, name: str) -> str | None:
    """The served name a client's name stands for: ours exactly, or with Ollama's ':latest' tag added or left off;
    None: no model of that name here."""
    registry = app.get(MODELS)
    names = registry.names if registry is not None else [app[GATEWAY].model_name]
    return next((c for c in (name, name.removesuffix(":latest"), f"{name}:latest") if c in names), None)


def usable_names(request: web.Request) -> list[str]:
    """The served names this request's key may use (the others are answered as if they did not exist)."""
    if MODELS in request.app:
        return visible_models(request)
    gateway = request.app[GATEWAY]
    try:
        gateway.check_model(gateway.model_name, request)
    except ApiError:
        return []
    return [gateway.model_name]


@contextlib.asynccontextmanager
async def using(request: web.Request, name: str, body: dict) -> AsyncIterator[Gateway]:
    """The model's gateway for this request: with several models, loaded if it was not and held until the answer is
    out, its keep_alive (the body's, if any) following (edge.http.model_pick); else the app's one."""
    if not several(request.app):
        yield request.app[GATEWAY]
        return
    priority = body.get("priority") if isinstance(body.get("priority"), int) else None
    async with use_model(request, name, body.get("keep_alive"), priority) as gateway:
        request[CHOSEN] = gateway
        yield gateway


def front_of(app: web.Application) -> Gateway:
    """The gateway whose checks are the server's own (the API key, the body's limits) and that counts a refusal
    made before a model is chosen (with several models, the front gateway of edge.models.app)."""
    return app[GATEWAY]


def _embedded_path() -> str | None:
    from prefill_cpu.embedded_model import embedded_model_path
    try:
        return embedded_model_path()
    except FileNotFoundError:
        return None


async def opened(request: web.Request, front: Gateway) -> tuple[dict, str]:
    """A generation or embedding request's common first checks: its key, its body (kept under BODY), the model it
    names and its keep_alive. ApiError: the first that fails."""
    front.check_key(request)
    body = request[BODY] = await read_json(request, front)
    name = model_named(request, body)
    keep_alive(body)
    return body, name


def keep_alive(body: dict) -> float | None:
    """Ollama's keep_alive (edge.models.spec: "5m", seconds, 0, -1) in seconds; None when the body has none."""
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return keep_alive_seconds(value)
    except ValueError as err:
        raise ApiError(400, f"'keep_alive': {err}", "keep_alive", "invalid_value") from None


def model_named(request: web.Request, body) -> str:
    """The served name of the model a body names (`model`, or Ollama's older `name`): a name not served here, or one
    the key may not use, is the same 404."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    sent = body.get("model") or body.get("name")
    if not isinstance(sent, str) or not sent:
        raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
    name = served(request.app, checked_text(sent, "model"))
    visible = usable_names(request)
    if name not in visible:
        raise model_not_found(sent, visible)
    return name


def refused_early(request: web.Request, gateway: Gateway, err: ApiError,
                  parsed: GenerateRequest | None = None) -> web.Response:
    """A refusal before admission, counted and heard by the observers as on every route."""
    gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
    gateway.rejected(request, err, parsed)
    return error_response(err)
