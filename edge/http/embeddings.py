"""POST /v1/embeddings (OpenAI's shape) and POST /v1/rerank (llama-server's and Jina's shape).

An embeddings or rerank request takes the completions' path through the gateway: the key, the policy (class,
priority, content filters, rate and concurrency limits, quota), the prefill queue, one terminal state in the audit
log and /metrics. A prefill worker computes the vectors with llama.cpp (prefill_cpu.embedder), pooled as the GGUF
says (mean when it says nothing) and L2-normalized, or a reranker's scores with its rank head; no decode engine
takes part, and neither waits for one.

An embedding GGUF is served on its own (Gateway.embedding_only, contracts.model_kind): its generation routes
answer 400 (generation_refused), and /v1/models and /health say what it is (model_facts).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import numpy as np
from aiohttp import web

from edge.api.fields import ApiError, checked_text, get_field, get_int, show
from edge.api.openai_request import GenerateRequest
from edge.api.sampling_request import SamplingRequest
from edge.core.gateway import Gateway
from edge.core.lifecycle import RequestStatus
from edge.http.body import read_json
from edge.http.model_pick import gateway_of

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request (and the documents of one rerank)
ENCODINGS = ("float", "base64")


@dataclasses.dataclass(frozen=True)
class EmbeddingsRequest:
    request: GenerateRequest  # kind "embedding", the inputs in embed_texts or embed_tokens
    encoding_format: str
    dimensions: int | None


def parse_embeddings(body, vocab_size: int | None) -> EmbeddingsRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = checked_text(get_field(body, "model", str, required=True), "model")
    texts, tokens = _inputs(body.get("input"), vocab_size)
    encoding = get_field(body, "encoding_format", str, default="float")
    if encoding not in ENCODINGS:
        raise ApiError(400, f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got {show(encoding)}",
                       "encoding_format", "invalid_value")
    dimensions = get_int(body, "dimensions", 1, 1 << 20, default=None)
    checked_text(get_field(body, "user", str, default=""), "user")
    priority = get_int(body, "priority", -1_000_000, 1_000_000, default=None)
    sampling = SamplingRequest(max_tokens=0)  # nothing is generated
    request = GenerateRequest("embedding", model, sampling, False, False, priority, user_text="\n".join(texts),
                              embed_texts=texts, embed_tokens=tokens)
    return EmbeddingsRequest(request, encoding, dimensions)


def _inputs(value, vocab_size: int | None) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if value is None:
        raise ApiError(400, "'input' is required", "input", "missing_required_parameter")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string, a non-empty list of strings, a list of token ids or a list of "
                            "lists of token ids", "input", "invalid_type")
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"'input' may hold at most {MAX_INPUTS} inputs, got {len(value)}", "input",
                       "invalid_value")
    if all(isinstance(v, str) for v in value):
        for i, text in enumerate(value):
            if not text:
                raise ApiError(400, f"input[{i}] is empty; an input must hold some text", f"input[{i}]",
                               "invalid_value")
        return tuple(checked_text(text, f"input[{i}]") for i, text in enumerate(value)), ()
    if all(isinstance(v, list) for v in value):
        return (), tuple(_token_input(v, i, vocab_size) for i, v in enumerate(value))
    raise ApiError(400, "'input' must be all strings or all lists of token ids, not a mix", "input", "invalid_type")


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_input(tokens: list, index: int, vocab_size: int | None) -> tuple[int, ...]:
    param = f"input[{index}]"
    if not tokens:
        raise ApiError(400, f"{param} is empty; an input must hold some tokens", param, "invalid_value")
    limit = vocab_size if vocab_size is not None else 1 << 31
    for j, token in enumerate(tokens):
        if not _is_token(token) or not 0 <= token < limit:
            raise ApiError(400, f"{param}[{j}] is {show(token)}, not a token id (0 to {limit - 1})", f"{param}[{j}]",
                           "invalid_value")
    return tuple(tokens)


def _check_dimensions(parsed: EmbeddingsRequest, gateway: Gateway) -> None:
    status = gateway.pool.embedding
    if parsed.dimensions is None or status is None or parsed.dimensions == status.n_embd:
        return
    raise ApiError(400, f"'dimensions' {parsed.dimensions} cannot be honoured: {gateway.model_name} makes embeddings "
                        f"of {status.n_embd} dimensions and was not trained to be cut shorter; leave 'dimensions' out",
                   "dimensions", "invalid_value")


def model_facts(gateway) -> dict:
    """What /v1/models and /health add for an embedding model served on its own: its task and pooling."""
    if not gateway.embedding_only:
        return {}
    status = gateway.pool.embedding
    pooling = status.pooling if status is not None else None
    return {"task": "rerank" if pooling == "rank" else "embedding", "pooling": pooling,
            "dimensions": status.n_embd if status is not None and pooling != "rank" else None}


def generation_refused(gateway, route: str) -> ApiError:
    """A generation route on an embedding model."""
    status = gateway.pool.embedding
    routes = "/v1/rerank" if status is not None and status.pooling == "rank" else "/v1/embeddings"
    return ApiError(400, f"{gateway.model_name} is an embedding model: it serves {routes}, /tokenize and "
                         f"/detokenize, not text generation ({route})", "model", "model_not_supported")


async def embeddings(request: web.Request) -> web.Response:
    gateway: Gateway = gateway_of(request)
    parsed = None
    try:
        gateway.check_key(request)
        parsed = parse_embeddings(await read_json(request, gateway), gateway.pool.vocab_size)
        gateway.check_model(parsed.request.model, request)
        status = gateway.pool.embedding
        if status is not None and status.pooling == "rank":
            raise ApiError(400, f"{gateway.model_name} is a reranker (a rank head scores query and document pairs): "
                                f"use /v1/rerank, not /v1/embeddings", "model", "model_not_supported")
        _check_dimensions(parsed, gateway)
        run = gateway.admit(request, parsed.request)
    except ApiError as err:
        return _refused(request, gateway, err, parsed.request if parsed else None)
    return await _served(gateway, run, "input",
                         lambda done, usage: _body(done, parsed.encoding_format, gateway.model_name, usage))


def _refused(request: web.Request, gateway: Gateway, err: ApiError, parsed: GenerateRequest | None) -> web.Response:
    gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
    gateway.rejected(request, err, parsed)
    return err.response()


async def _served(gateway: Gateway, run, param: str, body) -> web.Response:
    """An admitted embeddings or rerank request to its one terminal state. param: the field a too-long input came
    in; body(done, usage): the answer's JSON."""
    status, reason, usage, error = RequestStatus.ABORTED, "abort", None, None
    try:
        try:
            done = await gateway.embeddings(run, param)
        except ApiError as err:
            error = err
            status, reason = RequestStatus.FAILED, "error"
            response = error.response()
            response.headers.update(run.headers)
            return response
        usage = {"prompt_tokens": sum(done.num_tokens), "completion_tokens": 0, "total_tokens": sum(done.num_tokens)}
        run.inflight.num_prompt_tokens = usage["prompt_tokens"]
        status, reason = RequestStatus.FINISHED, "stop"
        return web.json_response(body(done, usage), headers=run.headers)
    except (asyncio.CancelledError, ConnectionResetError):
        status, reason = RequestStatus.ABORTED, "abort"  # the client went away
        raise
    finally:
        await asyncio.shield(gateway.end(run, status, reason, usage, error))


def _body(done, encoding: str, model: str, usage: dict) -> dict:
    vectors = np.frombuffer(done.vectors, dtype="<f4").reshape(len(done.num_tokens), done.dim)  # [n_inputs, dim]
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.tobytes()).decode("ascii") if encoding == "base64" else row.tolist()}
            for i, row in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]}}


@dataclasses.dataclass(frozen=True)
class RerankRequest:
    request: GenerateRequest  # kind "rerank", embed_texts: the query, then the documents
    documents: tuple[str, ...]
    top_n: int
    return_documents: bool


def parse_rerank(body) -> RerankRequest:
    """{model, query, documents (strings, or objects with a `text`), top_n?, return_documents?, priority?}"""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = checked_text(get_field(body, "model", str, required=True), "model")
    query = checked_text(get_field(body, "query", str, required=True), "query")
    if not query:
        raise ApiError(400, "'query' is empty; it must hold some text", "query", "invalid_value")
    documents = get_field(body, "documents", list, required=True)
    if not documents or len(documents) > MAX_INPUTS:
        raise ApiError(400, f"'documents' must hold 1 to {MAX_INPUTS} documents, got {len(documents)}", "documents",
                       "invalid_value")
    texts = tuple(_document(doc, i) for i, doc in enumerate(documents))
    top_n = get_int(body, "top_n", 1, 1 << 31, default=len(texts))
    return_documents = get_field(body, "return_documents", bool, default=False)
    checked_text(get_field(body, "user", str, default=""), "user")
    priority = get_int(body, "priority", -1_000_000, 1_000_000, default=None)
    sampling = SamplingRequest(max_tokens=0)  # nothing is generated
    request = GenerateRequest("rerank", model, sampling, False, False, priority, user_text="\n".join((query, *texts)),
                              embed_texts=(query, *texts))
    return RerankRequest(request, texts, min(top_n, len(texts)), return_documents)


def _document(value, index: int) -> str:
    param = f"documents[{index}]"
    if isinstance(value, dict):  # Jina's and Cohere's {"text": ...}
        value, param = value.get("text"), f"{param}.text"
    if not isinstance(value, str):
        raise ApiError(400, f"{param} must be a string (or an object with a 'text' string), not {show(value)}", param,
                       "invalid_type")
    if not value:
        raise ApiError(400, f"{param} is empty; a document must hold some text", param, "invalid_value")
    return checked_text(value, param)


async def rerank(request: web.Request) -> web.Response:
    """llama-server's /v1/rerank: each document scored against the query by the reranker's rank head, the results
    sorted by relevance_score, best first. A model without a rank head has nothing to score with: 400, not a ranking
    by something else."""
    gateway: Gateway = gateway_of(request)
    parsed = None
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        if isinstance(body, dict) and isinstance(body.get("model"), str):  # an unknown model first: 404
            gateway.check_model(body["model"], request)
        status = gateway.pool.embedding
        pooling = status.pooling if status is not None else "unknown"
        if pooling != "rank":
            raise ApiError(400, f"{gateway.model_name} has no rank head (its embeddings are pooled by {pooling}), so "
                                f"it cannot rerank; serve a reranker GGUF for /v1/rerank", "model",
                           "model_not_supported")
        parsed = parse_rerank(body)
        run = gateway.admit(request, parsed.request)
    except ApiError as err:
        return _refused(request, gateway, err, parsed.request if parsed else None)
    return await _served(gateway, run, "documents", lambda done, usage: _ranked(done, parsed, gateway.model_name,
                                                                                 usage))


def _ranked(done, parsed: RerankRequest, model: str, usage: dict) -> dict:
    scores = np.frombuffer(done.vectors, dtype="<f4").reshape(len(done.num_tokens), done.dim)[:, 0]  # [n_documents]
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:parsed.top_n]  # stable: ties keep order
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": parsed.documents[i]}} if parsed.return_documents else {})} for i in order]
    return {"object": "list", "model": model, "results": results,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]}}
