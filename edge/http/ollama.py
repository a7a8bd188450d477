"""Ollama's API (/api/...) for the clients that speak it (issue 45 item 6; docs/ollama.md).

/api/chat and /api/generate take the OpenAI routes' one path (edge.http.generate.generate) with Ollama's parser and
renderer (edge.api.ollama): the API key, the policy, admission and objectives, the trace and the audit record, one
terminal state. /api/embed (and the older /api/embeddings) take the embeddings' path: parse_embeddings' checks, the
gateway's admission and its one terminal state. /api/tags, /api/ps and /api/show describe the configured models
(edge.api.ollama_models); pull, push, create, copy, delete and blobs are refused (models come from the config).
Every error answers in Ollama's shape ({"error": "..."}) with our status: 400 bad input, 401 a missing or wrong
key, 404 a model that is not served here (or that the key may not use), 403 model management, 429/503 as the
policy and the load decide.

Which gateway serves a model is decided in one place: edge.http.ollama_served.models."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from aiohttp import web

from edge.api.fields import ApiError, get_field
from edge.api.ollama import OllamaApi, OllamaChatApi, OllamaGenerateApi, created_at, error_response
from edge.api.ollama_models import details, digest, display_name, listed
from edge.api.ollama_models import show as show_body
from edge.chat.tool_formats import chat_format_of
from edge.core.gateway import Gateway
from edge.http import generate, ollama_embed
from edge.http.body import read_json
from edge.http.model_file import chat_format
from edge.http.model_pick import gateway_of, several
from edge.http.ollama_served import (
    Configured,
    front_of,
    keep_alive,
    model_named,
    models,
    opened,
    refused_early,
    served,
    usable_names,
    using,
)

OLLAMA_VERSION = "0.13.0"  # the Ollama release whose API these routes follow (clients gate features on it)
FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)  # Ollama's expires_at for a model kept loaded (keep_alive -1)
REFUSED = {"/api/pull": "pulling", "/api/push": "pushing", "/api/create": "creating", "/api/copy": "copying",
           "/api/delete": "deleting", "/api/blobs/{digest}": "uploading blobs for"}
STREAMED = ("/api/chat", "/api/generate")  # answered as NDJSON (application/x-ndjson) when streamed


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show_model)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate_)
    app.router.add_post("/api/embed", ollama_embed.embed)
    app.router.add_post("/api/embeddings", ollama_embed.embeddings)
    for path in REFUSED:
        app.router.add_route("DELETE" if path == "/api/delete" else "POST", path, refused)
    app.router.add_route("HEAD", "/api/blobs/{digest}", refused)
    app.on_response_prepare.append(_ndjson)


async def version(request: web.Request) -> web.Response:
    """GET /api/version: what clients ask first; answered without a key, as /health is."""
    return web.json_response({"version": OLLAMA_VERSION})


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generation(request, OllamaChatApi(*_hooks(request)), "messages")


async def generate_(request: web.Request) -> web.StreamResponse:
    return await _generation(request, OllamaGenerateApi(*_hooks(request)), "prompt")


def _hooks(request: web.Request) -> tuple:
    """What an OllamaApi asks of the server: the served name for a client's, and a request's timestamps (its
    InFlight in the gateway that serves it, until its terminal state)."""
    return (lambda name: served(request.app, name)), (lambda rid: gateway_of(request).registry.get(rid))


async def _generation(request: web.Request, api: OllamaApi, field: str) -> web.StreamResponse:
    """An empty `messages` or `prompt` only loads the model (Ollama's load request); anything else is generated on
    the OpenAI routes' path, on the named model's gateway."""
    front = front_of(request.app)
    try:
        body, name = await opened(request, front)
    except ApiError as err:
        return refused_early(request, front, err)
    try:
        if body.get(field) in (None, [], ""):
            return await _load(request, body, name, "message" if field == "messages" else "response")
        async with using(request, name, body):
            return await generate.generate(request, api)
    except ApiError as err:  # the model could not be had (its load failed, no memory for it): before its handler
        return refused_early(request, front, err)


async def _load(request: web.Request, body: dict, name: str, text: str) -> web.Response:
    """Ollama's load request: the model is loaded (keep_alive 0: unloaded once idle) and nothing is generated."""
    reason = "unload" if keep_alive(body) == 0 else "load"
    if reason == "unload":
        configured = models(request.app)[name]
        if not several(request.app) or configured.pinned:
            why = "pinned" if several(request.app) else "the one model this server serves"
            raise ApiError(400, f"{name} cannot be unloaded: it is {why}, loaded while the server runs (keep_alive 0 "
                                f"with an empty request unloads a model on Ollama)", "keep_alive", "invalid_value")
        if configured.state != "loaded":
            return _loaded(body, text, reason)  # nothing to unload
    async with using(request, name, body):  # loaded if it was not; keep_alive 0 unloads it once it is idle
        pass
    return _loaded(body, text, reason)


def _loaded(body: dict, text: str, reason: str) -> web.Response:
    answer = {"role": "assistant", "content": ""} if text == "message" else ""
    sent = body.get("model") or body.get("name")
    return web.json_response({"model": sent, "created_at": created_at(), text: answer, "done_reason": reason,
                              "done": True})


async def tags(request: web.Request) -> web.Response:
    """GET /api/tags: every configured model the key may use, loaded or not."""
    try:
        front_of(request.app).check_key(request)
    except ApiError as err:
        return error_response(err)
    configured, visible = models(request.app), usable_names(request)
    return web.json_response({"models": [listed(name, configured[name].path) for name in visible]})


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the loaded models the key may use: the memory their processes hold (PSS, else RSS), when their
    keep_alive unloads them (Ollama's far future for never)."""
    try:
        front_of(request.app).check_key(request)
    except ApiError as err:
        return error_response(err)
    configured = models(request.app)
    entries = [_running(configured[name]) for name in usable_names(request) if configured[name].state == "loaded"]
    return web.json_response({"models": entries})


def _running(model: Configured) -> dict:
    memory = model.memory or {}
    expires = datetime.now(UTC) + FOREVER if model.expires_at is None else datetime.fromtimestamp(model.expires_at, UTC)
    return {"name": display_name(model.name), "model": display_name(model.name),
            "size": memory.get("pss") or memory.get("rss") or 0, "digest": digest(model.path),
            "details": details(model.path), "expires_at": expires.isoformat().replace("+00:00", "Z"), "size_vram": 0,
            "context_length": model.gateway.events.context_tokens() if model.gateway is not None else 0}


async def show_model(request: web.Request) -> web.Response:
    """POST /api/show: the model's details, metadata, chat template and capabilities (loaded or not)."""
    front = front_of(request.app)
    try:
        front.check_key(request)
        body = await read_json(request, front)
        name = model_named(request, body)
        verbose = get_field(body, "verbose", bool, default=False)
    except ApiError as err:
        return refused_early(request, front, err)
    model = models(request.app)[name]
    capabilities = await _capabilities(model, front)
    return web.json_response(await asyncio.to_thread(show_body, model.path, verbose, capabilities))


async def _capabilities(model: Configured, front: Gateway) -> list[str]:
    """completion and tools (calls are parsed in any chat template's format, Hermes' where it has none), thinking
    for a reasoning model; embedding alone for an embedding model served on its own."""
    if model.gateway is not None and model.gateway.embedding_only:
        return ["embedding"]
    if model.gateway is not None:
        form = await chat_format(model.gateway)
    else:  # not loaded: its template read from its GGUF
        form = await chat_format_of(model.path, front.config.tool_call_parser, front.config.reasoning_parser)
    return ["completion", "tools"] + (["thinking"] if form.reasoning else [])


async def refused(request: web.Request) -> web.Response:
    """pull, push, create, copy, delete, blobs: the models are the config's, so none of these is done here."""
    gateway = front_of(request.app)
    try:
        gateway.check_key(request)
        what = REFUSED[request.match_info.route.resource.canonical]
        raise ApiError(403, f"{what} models is not supported: edge serve serves the models its config names (the "
                            f"model key or [[models]] tables, docs/models.md); an operator adds or removes one there",
                       code="model_management_unsupported")
    except ApiError as err:
        return refused_early(request, gateway, err)


async def _ndjson(request: web.Request, response: web.StreamResponse) -> None:
    """A streamed /api/chat or /api/generate answer is NDJSON, as Ollama's: the shared stream (edge.http.stream)
    opens every stream as server-sent events, and the Ollama writer writes JSON lines instead."""
    if request.path in STREAMED and response.headers.get("Content-Type") == "text/event-stream":
        response.headers["Content-Type"] = "application/x-ndjson"
