"""Ollama's API (/api/...) for the clients that speak it (issue 45 item 6; docs/ollama.md).

/api/chat and /api/generate take the OpenAI routes' one path (edge.http.generate.generate) with Ollama's parser and
renderer (edge.api.ollama): the API key, the policy, admission and objectives, the trace and the audit record, one
terminal state. /api/embed (and the older /api/embeddings) take the embeddings' path: parse_embeddings' checks, the
gateway's admission and its one terminal state. /api/tags, /api/ps and /api/show describe the configured models
(edge.api.ollama_models); pull, push, create, copy, delete and blobs are refused (models come from the config).
Every error answers in Ollama's shape ({"error": "..."}) with our status: 400 bad input, 401 a missing or wrong
key, 404 a model that is not served here (or that the key may not use), 403 model management, 429/503 as the
policy and the load decide.

Which gateway serves a model is decided in one place, `models`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
from aiohttp import web

from edge.api.errors import model_not_found
from edge.api.fields import ApiError, checked_text, get_field, show
from edge.api.generate_request import GenerateRequest
from edge.api.ollama import OllamaApi, OllamaChatApi, OllamaGenerateApi, created_at, error_response
from edge.api.ollama_models import details, digest, display_name, listed
from edge.api.ollama_models import show as show_body
from edge.chat.tool_formats import chat_format_of
from edge.config import keep_alive_seconds  # edge.models.spec's, as the config reads [[models]] keep_alive
from edge.core.gateway import Gateway
from edge.core.lifecycle import RequestStatus
from edge.http import generate
from edge.http.body import BODY, read_json
from edge.http.embeddings import parse_embeddings
from edge.http.model_file import chat_format, model_path
from edge.http.model_pick import CHOSEN, gateway_of, several, use_model, visible_models
from edge.state import GATEWAY, MODELS

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
    app.router.add_post("/api/embed", embed)
    app.router.add_post("/api/embeddings", embeddings)
    for path in REFUSED:
        app.router.add_route("DELETE" if path == "/api/delete" else "POST", path, refused)
    app.router.add_route("HEAD", "/api/blobs/{digest}", refused)
    app.on_response_prepare.append(_ndjson)


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


def _visible(request: web.Request) -> list[str]:
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
async def _using(request: web.Request, name: str, body: dict) -> AsyncIterator[Gateway]:
    """The model's gateway for this request: with several models, loaded if it was not and held until the answer is
    out, its keep_alive (the body's, if any) following (edge.http.model_pick); else the app's one."""
    if not several(request.app):
        yield request.app[GATEWAY]
        return
    priority = body.get("priority") if isinstance(body.get("priority"), int) else None
    async with use_model(request, name, body.get("keep_alive"), priority) as gateway:
        request[CHOSEN] = gateway
        yield gateway


def _front(app: web.Application) -> Gateway:
    """The gateway whose checks are the server's own (the API key, the body's limits) and that counts a refusal
    made before a model is chosen (with several models, the front gateway of edge.models.app)."""
    return app[GATEWAY]


def _embedded_path() -> str | None:
    from prefill_cpu.embedded_model import embedded_model_path
    try:
        return embedded_model_path()
    except FileNotFoundError:
        return None


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
    front = _front(request.app)
    try:
        front.check_key(request)
        body = request[BODY] = await read_json(request, front)
        name = _model(request, body)
        keep_alive(body)
    except ApiError as err:
        return _refused(request, front, err)
    try:
        if body.get(field) in (None, [], ""):
            return await _load(request, body, name, "message" if field == "messages" else "response")
        async with _using(request, name, body):
            return await generate.generate(request, api)
    except ApiError as err:  # the model could not be had (its load failed, no memory for it): before its handler
        return _refused(request, front, err)


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
    async with _using(request, name, body):  # loaded if it was not; keep_alive 0 unloads it once it is idle
        pass
    return _loaded(body, text, reason)


def _loaded(body: dict, text: str, reason: str) -> web.Response:
    answer = {"role": "assistant", "content": ""} if text == "message" else ""
    return web.json_response({"model": body["model"], "created_at": created_at(), text: answer, "done_reason": reason,
                              "done": True})


def keep_alive(body: dict) -> float | None:
    """Ollama's keep_alive (edge.models.spec: "5m", seconds, 0, -1) in seconds; None when the body has none."""
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return keep_alive_seconds(value)
    except ValueError as err:
        raise ApiError(400, f"'keep_alive': {err}", "keep_alive", "invalid_value") from None


def _model(request: web.Request, body) -> str:
    """The served name of the model a body names (`model`, or Ollama's older `name`): a name not served here, or one
    the key may not use, is the same 404."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    sent = body.get("model") or body.get("name")
    if not isinstance(sent, str) or not sent:
        raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
    name = served(request.app, checked_text(sent, "model"))
    visible = _visible(request)
    if name not in visible:
        raise model_not_found(sent, visible)
    return name


def _refused(request: web.Request, gateway: Gateway, err: ApiError,
             parsed: GenerateRequest | None = None) -> web.Response:
    """A refusal before admission, counted and heard by the observers as on every route."""
    gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
    gateway.rejected(request, err, parsed)
    return error_response(err)


async def tags(request: web.Request) -> web.Response:
    """GET /api/tags: every configured model the key may use, loaded or not."""
    try:
        _front(request.app).check_key(request)
    except ApiError as err:
        return error_response(err)
    configured, visible = models(request.app), _visible(request)
    return web.json_response({"models": [listed(name, configured[name].path) for name in visible]})


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the loaded models the key may use: the memory their processes hold (PSS, else RSS), when their
    keep_alive unloads them (Ollama's far future for never)."""
    try:
        _front(request.app).check_key(request)
    except ApiError as err:
        return error_response(err)
    configured = models(request.app)
    entries = [_running(configured[name]) for name in _visible(request) if configured[name].state == "loaded"]
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
    front = _front(request.app)
    try:
        front.check_key(request)
        body = await read_json(request, front)
        name = _model(request, body)
        verbose = get_field(body, "verbose", bool, default=False)
    except ApiError as err:
        return _refused(request, front, err)
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


async def embed(request: web.Request) -> web.Response:
    """POST /api/embed: {"model", "input": text or texts} -> {"embeddings": [...]} (L2-normalized, as Ollama's)."""
    return await _embeddings(request, "input")


async def embeddings(request: web.Request) -> web.Response:
    """POST /api/embeddings, Ollama's older route: {"model", "prompt"} -> {"embedding": [...]}."""
    return await _embeddings(request, "prompt")


async def _embeddings(request: web.Request, field: str) -> web.Response:
    started = time.perf_counter()
    front = _front(request.app)
    try:
        front.check_key(request)
        body = request[BODY] = await read_json(request, front)
        name = _model(request, body)
        keep_alive(body)
        texts = _texts(body.get(field), field)
    except ApiError as err:
        return _refused(request, front, err)
    if not texts:  # Ollama's load request: nothing to embed
        return await _load_embedder(request, body, name, field)
    try:
        async with _using(request, name, body) as gateway:
            return await _embed(request, gateway, body, name, texts, field, started)
    except ApiError as err:  # the model could not be had
        return _refused(request, front, err)


async def _load_embedder(request: web.Request, body: dict, name: str, field: str) -> web.Response:
    try:
        async with _using(request, name, body):
            pass
    except ApiError as err:
        return _refused(request, _front(request.app), err)
    return web.json_response({"model": body["model"], "embeddings": []} if field == "input" else {"embedding": []})


async def _embed(request: web.Request, gateway: Gateway, body: dict, name: str, texts: tuple[str, ...], field: str,
                 started: float) -> web.Response:
    """The embeddings' checks and admission on the model's gateway, then the worker's vectors."""
    parsed = None
    try:
        parsed = parse_embeddings({"model": name, "input": list(texts), "priority": body.get("priority")},
                                  gateway.pool.vocab_size).request
        _check_embedding(gateway, body.get("dimensions"))
        run = gateway.admit(request, parsed)
    except ApiError as err:
        return _refused(request, gateway, err, parsed)
    return await _embedded(gateway, run, body["model"], field, started)


def _texts(value, field: str) -> tuple[str, ...]:
    if value is None or value == "" or value == []:
        return ()
    if field == "input" and isinstance(value, list) and all(isinstance(text, str) for text in value):
        return tuple(value)
    if isinstance(value, str):
        return (value,)
    expected = "a string or a list of strings" if field == "input" else "a string"
    raise ApiError(400, f"{field!r} must be {expected}, not {show(value)}", field, "invalid_type")


def _check_embedding(gateway: Gateway, dimensions) -> None:
    status = gateway.pool.embedding
    if status is not None and status.pooling == "rank":
        raise ApiError(400, f"{gateway.model_name} is a reranker (a rank head scores query and document pairs): use "
                            f"/v1/rerank, not /api/embed", "model", "model_not_supported")
    if dimensions is not None and (status is None or dimensions != status.n_embd):
        raise ApiError(400, f"'dimensions' {show(dimensions)} cannot be honoured: {gateway.model_name}'s embeddings "
                            f"were not trained to be cut shorter; leave 'dimensions' out", "dimensions",
                       "invalid_value")


async def _embedded(gateway: Gateway, run, sent: str, field: str, started: float) -> web.Response:
    """An admitted embeddings request to its one terminal state (aborted if the client goes away)."""
    status, reason, usage, error = RequestStatus.ABORTED, "abort", None, None
    try:
        try:
            done = await gateway.embeddings(run, "input")
        except ApiError as err:
            status, reason, error = RequestStatus.FAILED, "error", err
            response = error_response(err)
            response.headers.update(run.headers)
            return response
        tokens = sum(done.num_tokens)
        usage = {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
        run.inflight.num_prompt_tokens = tokens
        status, reason = RequestStatus.FINISHED, "stop"
        vectors = np.frombuffer(done.vectors, dtype="<f4").reshape(len(done.num_tokens), done.dim)  # [n_inputs, dim]
        if field == "prompt":
            return web.json_response({"embedding": vectors[0].tolist()}, headers=run.headers)
        body = {"model": sent, "embeddings": vectors.tolist(),
                "total_duration": round((time.perf_counter() - started) * 1e9),
                "load_duration": round((run.inflight.created - started) * 1e9), "prompt_eval_count": tokens}
        return web.json_response(body, headers=run.headers)
    finally:
        await asyncio.shield(gateway.end(run, status, reason, usage, error))


async def refused(request: web.Request) -> web.Response:
    """pull, push, create, copy, delete, blobs: the models are the config's, so none of these is done here."""
    gateway = _front(request.app)
    try:
        gateway.check_key(request)
        what = REFUSED[request.match_info.route.resource.canonical]
        raise ApiError(403, f"{what} models is not supported: edge serve serves the models its config names (the "
                            f"model key or [[models]] tables, docs/models.md); an operator adds or removes one there",
                       code="model_management_unsupported")
    except ApiError as err:
        return _refused(request, gateway, err)


async def _ndjson(request: web.Request, response: web.StreamResponse) -> None:
    """A streamed /api/chat or /api/generate answer is NDJSON, as Ollama's: the shared stream (edge.http.stream)
    opens every stream as server-sent events, and the Ollama writer writes JSON lines instead."""
    if request.path in STREAMED and response.headers.get("Content-Type") == "text/event-stream":
        response.headers["Content-Type"] = "application/x-ndjson"
