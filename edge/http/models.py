"""The models routes with [[models]] (issue 45): GET /v1/models lists every configured model the key may use with its
state (loaded, loading, unloading, unloaded, failed) and memory; GET /v1/models/{id} one of them; admin-only POST
/v1/models/{id}/load and /unload (401 without a key the policy knows, 403 for a key without admin = true, as
DELETE /v1/kv_cache). A single-model app answers GET as before (edge.http.health)."""

from __future__ import annotations

from aiohttp import web

from edge.api.fields import ApiError
from edge.http.embeddings import model_facts
from edge.http.kv_cache import check_admin
from edge.http.model_pick import check_visible, visible_models
from edge.models.registry import LOADED
from edge.state import GATEWAY, MODELS


def model_list(request: web.Request) -> web.Response:
    request.app[GATEWAY].check_key(request)
    registry = request.app[MODELS]
    visible = set(visible_models(request))
    return web.json_response({"object": "list", "data": [_card(registry, d) for d in registry.describe()
                                                         if d["name"] in visible]})


def model_card(request: web.Request) -> web.Response:
    request.app[GATEWAY].check_key(request)
    name = check_visible(request, request.match_info["model_id"])
    return web.json_response(_card(request.app[MODELS], _described(request, name)))


async def load(request: web.Request) -> web.Response:
    """Load the model now (a failed one is tried again); answers once it is loaded, or with the load's 503."""
    name = _admin_target(request)
    return web.json_response(_card(request.app[MODELS], await request.app[MODELS].load(name)))


async def unload(request: web.Request) -> web.Response:
    """Unload the model now (pinned ones too); 409 model_busy while it has requests in flight."""
    name = _admin_target(request)
    return web.json_response(_card(request.app[MODELS], await request.app[MODELS].unload(name)))


def _admin_target(request: web.Request) -> str:
    check_admin(request.app[GATEWAY].enforcer.policy, request, "load and unload models")
    registry, name = request.app[MODELS], request.match_info["model_id"]
    if not registry.several:
        raise ApiError(400, "this server serves one model (no [[models]] in its config): it is loaded while the "
                            "server runs", "model", "model_not_unloadable")
    if name not in registry.slots:
        raise ApiError(404, f"the model {name!r} is not configured; configured: {', '.join(registry.names)}",
                       "model", "model_not_found")
    return name


def _described(request: web.Request, name: str) -> dict:
    return next(d for d in request.app[MODELS].describe() if d["name"] == name)


def _card(registry, described: dict) -> dict:
    """OpenAI's model object, with what an operator needs: state, memory (planned bytes per budget, measured RSS
    and PSS of its processes while loaded), keep_alive, pinned, loaded_at, expires_at, and why it failed."""
    card = {"id": described["name"], "object": "model", "created": int(described["loaded_at"] or 0),
            "owned_by": "edge", **{k: described[k] for k in ("state", "memory", "keep_alive", "pinned", "loaded_at",
                                                             "expires_at", "in_flight", "error")}}
    stack = registry.stack(described["name"]) if described["state"] == LOADED else None
    return {**card, **(model_facts(stack.gateway) if stack is not None else {})}
