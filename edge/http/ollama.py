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
import time
from datetime import UTC, datetime, timedelta

import numpy as np
from aiohttp import web

from edge.api.fields import ApiError, checked_text, get_field, show
from edge.api.generate_request import GenerateRequest
from edge.api.ollama import OllamaApi, OllamaChatApi, OllamaGenerateApi, created_at, error_response
from edge.api.ollama_models import details, digest, display_name, listed
from edge.api.ollama_models import show as show_body
from edge.config import keep_alive_seconds  # edge.models.spec's, as the config reads [[models]] keep_alive
from edge.core.gateway import Gateway
from edge.core.lifecycle import RequestStatus
from edge.http import generate
from edge.http.body import read_json
from edge.http.embeddings import parse_embeddings
from edge.http.model_file import chat_format, model_path
from edge.observe.process_memory import memory_report
from edge.state import GATEWAY, SUPERVISOR

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


def models(app: web.Application) -> dict[str, Gateway]:
    """Every configured model by its served name, with the gateway that serves it: the one place the routes learn
    which models exist (the multi-model registry replaces this body)."""
    gateway = app[GATEWAY]
    return {gateway.model_name: gateway}


def served(app: web.Application, name: str) -> tuple[str, Gateway] | None:
    """(the served name, its gateway) for a client's name: ours exactly, or with Ollama's ':latest' tag (added or
    left off); None: no model of that name here."""
    found = models(app)
    for candidate in (name, name.removesuffix(":latest"), f"{name}:latest"):
        if candidate in found:
            return candidate, found[candidate]
    return None


def _server(app: web.Application) -> Gateway:
    """The gateway whose checks are the server's own (the API key, the body's limits), before a model is known."""
    return app[GATEWAY]


async def version(request: web.Request) -> web.Response:
    """GET /api/version: what clients ask first; answered without a key, as /health is."""
    return web.json_response({"version": OLLAMA_VERSION})


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generation(request, OllamaChatApi(lambda name: served(request.app, name)), "messages")


async def generate_(request: web.Request) -> web.StreamResponse:
    return await _generation(request, OllamaGenerateApi(lambda name: served(request.app, name)), "prompt")


async def _generation(request: web.Request, api: OllamaApi, field: str) -> web.StreamResponse:
    """An empty `messages` or `prompt` only loads the model (Ollama's load request); anything else is generated on
    the OpenAI routes' path (which reads the body again from aiohttp's copy of it)."""
    gateway = _server(request.app)
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        if isinstance(body, dict):
            keep_alive(body)
    except ApiError as err:
        return _refused(request, gateway, err)
    if isinstance(body, dict) and body.get(field) in (None, [], ""):
        return await _load(request, body, "message" if field == "messages" else "response")
    return await generate.generate(request, api)


async def _load(request: web.Request, body: dict, text: str) -> web.Response:
    """Ollama's load request: the model is loaded (or, keep_alive 0, unloaded) and nothing is generated."""
    try:
        name, gateway = _model(request, body)
        if keep_alive(body) == 0:
            raise ApiError(400, f"{name} cannot be unloaded: this server serves one model, loaded while it runs "
                                f"(keep_alive 0 with an empty request unloads a model on Ollama)", "keep_alive",
                           "invalid_value")
    except ApiError as err:
        return _refused(request, _server(request.app), err)
    answer = {"role": "assistant", "content": ""} if text == "message" else ""
    return web.json_response({"model": body["model"], "created_at": created_at(), text: answer, "done_reason": "load",
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


def _model(request: web.Request, body) -> tuple[str, Gateway]:
    """The model a body names (`model`, or Ollama's older `name`), checked as every route checks it: a name not
    served here, or one the key may not use, is a 404."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    sent = body.get("model") or body.get("name")
    if not isinstance(sent, str) or not sent:
        raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
    found = served(request.app, checked_text(sent, "model"))
    if found is None:
        _server(request.app).check_model(sent)  # the 404, naming the models the key may use
        raise ApiError(404, f"the model {sent!r} does not exist here", "model", "model_not_found")
    name, gateway = found
    gateway.check_model(name)
    return name, gateway


def _refused(request: web.Request, gateway: Gateway, err: ApiError,
             parsed: GenerateRequest | None = None) -> web.Response:
    """A refusal before admission, counted and heard by the observers as on every route."""
    gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
    gateway.rejected(request, err, parsed)
    return error_response(err)


async def tags(request: web.Request) -> web.Response:
    """GET /api/tags: every configured model the key may use."""
    try:
        _server(request.app).check_key(request)
    except ApiError as err:
        return error_response(err)
    entries = [listed(name, model_path(gateway), _fingerprint(gateway)) for name, gateway in _usable(request)]
    return web.json_response({"models": entries})


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the loaded models the key may use, with the memory their processes hold (PSS, else RSS)."""
    try:
        _server(request.app).check_key(request)
    except ApiError as err:
        return error_response(err)
    memory = memory_report(request.app, request.app.get(SUPERVISOR))["total"]
    size = memory["pss"] if memory["pss"] is not None else memory["rss"]
    expires = (datetime.now(UTC) + FOREVER).isoformat().replace("+00:00", "Z")
    entries = [{"name": display_name(name), "model": display_name(name), "size": size,
                "digest": digest(model_path(gateway), _fingerprint(gateway)), "details": details(model_path(gateway)),
                "expires_at": expires, "size_vram": 0, "context_length": gateway.events.context_tokens()}
               for name, gateway in _usable(request) if gateway.components_ready]
    return web.json_response({"models": entries})


def _usable(request: web.Request) -> list[tuple[str, Gateway]]:
    usable = []
    for name, gateway in models(request.app).items():
        try:
            gateway.check_model(name)
        except ApiError:
            continue  # the key may not use it: not listed, as if it did not exist
        usable.append((name, gateway))
    return usable


def _fingerprint(gateway: Gateway) -> str | None:
    """The GGUF's SHA-256 as a prefill worker computed it at its start (None before one reported)."""
    return next((w.info.model_fingerprint for w in gateway.pool.workers.values() if w.info is not None), None)


async def show_model(request: web.Request) -> web.Response:
    """POST /api/show: the model's details, metadata, chat template and capabilities."""
    gateway = _server(request.app)
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        name, gateway = _model(request, body)
        verbose = get_field(body, "verbose", bool, default=False)
    except ApiError as err:
        return _refused(request, _server(request.app), err)
    capabilities = ["embedding"] if gateway.embedding_only else await _capabilities(gateway)
    return web.json_response(await asyncio.to_thread(show_body, model_path(gateway), verbose, capabilities))


async def _capabilities(gateway: Gateway) -> list[str]:
    """completion and tools (calls are parsed in any chat template's format, Hermes' where it has none), thinking
    for a reasoning model."""
    form = await chat_format(gateway)
    return ["completion", "tools"] + (["thinking"] if form.reasoning else [])


async def embed(request: web.Request) -> web.Response:
    """POST /api/embed: {"model", "input": text or texts} -> {"embeddings": [...]} (L2-normalized, as Ollama's)."""
    return await _embeddings(request, "input")


async def embeddings(request: web.Request) -> web.Response:
    """POST /api/embeddings, Ollama's older route: {"model", "prompt"} -> {"embedding": [...]}."""
    return await _embeddings(request, "prompt")


async def _embeddings(request: web.Request, field: str) -> web.Response:
    started = time.perf_counter()
    gateway, parsed = _server(request.app), None
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        name, gateway = _model(request, body)
        keep_alive(body)
        texts = _texts(body.get(field), field)
        if not texts:  # Ollama's load request: nothing to embed
            return web.json_response({"model": body["model"], "embeddings": []} if field == "input"
                                     else {"embedding": []})
        parsed = parse_embeddings({"model": name, "input": list(texts), "priority": body.get("priority")},
                                  gateway.pool.vocab_size).request
        _check_embedding(gateway, body.get("dimensions"))
        run = gateway.admit(request, parsed)
    except ApiError as err:
        return _refused(request, gateway, err, parsed)
    return await _embedded(gateway, run, body["model"], field, started)


def _texts(value, field: str) -> tuple[str, ...]:
    if value is None or value == "":
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
    gateway = _server(request.app)
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
