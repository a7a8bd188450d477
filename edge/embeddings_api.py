"""POST /v1/embeddings (OpenAI's shape) and POST /v1/rerank.

An embeddings request takes the completions' path through the gateway: the key, the policy (class, priority,
content filters, rate and concurrency limits, quota), the prefill queue, one terminal state in the audit log and
/metrics. A prefill worker computes the vectors with llama.cpp (prefill_cpu.embedder), pooled as the GGUF says
(mean when it says nothing) and L2-normalized; no decode engine takes part.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import numpy as np
from aiohttp import web

from contracts.handoff import SamplingParams
from edge.gateway import Gateway
from edge.lifecycle import RequestStatus
from edge.openai_api import GenerateRequest
from edge.request_fields import ApiError, checked_text, get_field, get_int, show
from edge.state import GATEWAY

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
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
    sampling = dataclasses.asdict(SamplingParams(max_tokens=0))  # nothing is generated
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


async def embeddings(request: web.Request, read_json) -> web.Response:
    """read_json: the routes' body reader (size and time limits, JSON errors)."""
    gateway: Gateway = request.app[GATEWAY]
    parsed = None
    try:
        gateway.check_key(request)
        parsed = parse_embeddings(await read_json(request, gateway), gateway.pool.vocab_size)
        _check_dimensions(parsed, gateway)
        run = gateway.admit(request, parsed.request)
    except ApiError as err:
        gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
        gateway.rejected(request, err, parsed.request if parsed else None)
        return err.response()
    status, reason, usage, error = RequestStatus.ABORTED, "abort", None, None
    try:
        try:
            done = await gateway.embeddings(run)
        except ApiError as err:
            error = _renamed(err)
            status, reason = RequestStatus.FAILED, "error"
            response = error.response()
            response.headers.update(run.headers)
            return response
        usage = {"prompt_tokens": sum(done.num_tokens), "completion_tokens": 0, "total_tokens": sum(done.num_tokens)}
        run.inflight.num_prompt_tokens = usage["prompt_tokens"]
        status, reason = RequestStatus.FINISHED, "stop"
        return web.json_response(_body(done, parsed.encoding_format, gateway.model_name, usage), headers=run.headers)
    except (asyncio.CancelledError, ConnectionResetError):
        status, reason = RequestStatus.ABORTED, "abort"  # the client went away
        raise
    finally:
        await asyncio.shield(gateway.end(run, status, reason, usage, error))


def _renamed(err: ApiError) -> ApiError:
    """A worker's refusal names 'input', the field it came from."""
    if err.param in ("messages", "prompt"):
        return ApiError(err.status, err.message, "input", err.code, err.error_type, err.headers)
    return err


def _body(done, encoding: str, model: str, usage: dict) -> dict:
    vectors = np.frombuffer(done.vectors, dtype="<f4").reshape(len(done.num_tokens), done.dim)  # [n_inputs, dim]
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.tobytes()).decode("ascii") if encoding == "base64" else row.tolist()}
            for i, row in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]}}


async def rerank(request: web.Request, read_json) -> web.Response:
    """llama-server's and vLLM's /v1/rerank scores documents with a reranker's rank head; a model without one has
    nothing to score them with, so the route says so instead of ranking by something else."""
    gateway: Gateway = request.app[GATEWAY]
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        status = gateway.pool.embedding
        pooling = status.pooling if status is not None else "unknown"
        if pooling != "rank":
            raise ApiError(400, f"{gateway.model_name} has no rank head (its embeddings are pooled by {pooling}), so "
                                f"it cannot rerank; serve a reranker GGUF for /v1/rerank", "model",
                           "model_not_supported")
        raise ApiError(501, "reranking with a rank head is not implemented by this server yet", "model",
                       "not_implemented", "server_error")
    except ApiError as err:
        gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
        gateway.rejected(request, err, None)
        return err.response()
