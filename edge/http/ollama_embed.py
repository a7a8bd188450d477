"""POST /api/embed and Ollama's older /api/embeddings: the embeddings' checks (parse_embeddings) and admission on the
named model's gateway, the worker's L2-normalized vectors, one terminal state; errors in Ollama's shape."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from aiohttp import web

from edge.api.fields import ApiError, show
from edge.api.ollama import error_response
from edge.core.gateway import Gateway
from edge.core.lifecycle import RequestStatus
from edge.http.embeddings import parse_embeddings
from edge.http.ollama_served import front_of, opened, refused_early, using


async def embed(request: web.Request) -> web.Response:
    """POST /api/embed: {"model", "input": text or texts} -> {"embeddings": [...]} (L2-normalized, as Ollama's)."""
    return await _embeddings(request, "input")


async def embeddings(request: web.Request) -> web.Response:
    """POST /api/embeddings, Ollama's older route: {"model", "prompt"} -> {"embedding": [...]}."""
    return await _embeddings(request, "prompt")


async def _embeddings(request: web.Request, field: str) -> web.Response:
    started = time.perf_counter()
    front = front_of(request.app)
    try:
        body, name = await opened(request, front)
        texts = _texts(body.get(field), field)
    except ApiError as err:
        return refused_early(request, front, err)
    if not texts:  # Ollama's load request: nothing to embed
        return await _load_embedder(request, body, name, field)
    try:
        async with using(request, name, body) as gateway:
            return await _embed(request, gateway, body, name, texts, field, started)
    except ApiError as err:  # the model could not be had
        return refused_early(request, front, err)


async def _load_embedder(request: web.Request, body: dict, name: str, field: str) -> web.Response:
    try:
        async with using(request, name, body):
            pass
    except ApiError as err:
        return refused_early(request, front_of(request.app), err)
    sent = body.get("model") or body.get("name")
    return web.json_response({"model": sent, "embeddings": []} if field == "input" else {"embedding": []})


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
        return refused_early(request, gateway, err, parsed)
    return await _embedded(gateway, run, body.get("model") or body.get("name"), field, started)


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
        queued = run.inflight.created + run.inflight.load_wait_s  # created was moved back by its model's load
        body = {"model": sent, "embeddings": vectors.tolist(),
                "total_duration": round((time.perf_counter() - started) * 1e9),
                "load_duration": round((queued - started) * 1e9), "prompt_eval_count": tokens}
        return web.json_response(body, headers=run.headers)
    finally:
        await asyncio.shield(gateway.end(run, status, reason, usage, error))
