"""The generation routes: OpenAI chat completions and completions, OpenAI Responses, Anthropic Messages. One path for
all of them: the key, the body, the API's parser (edge.api.client_api), the structured-output check, admission, then
the answer collected or streamed (edge.http.stream) and the request's one terminal state."""

from __future__ import annotations

import asyncio

from aiohttp import web

from contracts.grammar_compile import compile_timeout_s
from edge.api.chat_completions import ChatCompletionsApi
from edge.api.client_api import ClientApi
from edge.api.completion import Completion
from edge.api.completions import CompletionsApi
from edge.api.messages import MessagesApi
from edge.api.openai_request import ApiError, GenerateRequest
from edge.api.responses import ResponsesApi
from edge.api.structured import check_structured, compile_owner
from edge.core.gateway import Gateway, Run, bearer_key
from edge.core.lifecycle import RequestStatus
from edge.http.body import read_json
from edge.http.completion_batch import serve_batch, stream_batch
from edge.http.embeddings import generation_refused
from edge.http.model_file import chat_format, model_path
from edge.http.model_pick import gateway_of
from edge.http.stream import collect, stream
from edge.state import GATEWAY, GRAMMAR_CHECKS, RESPONSES
from policies.quota import key_id

CHAT_COMPLETIONS, COMPLETIONS = ChatCompletionsApi(), CompletionsApi()
RESPONSES_API, MESSAGES = ResponsesApi(), MessagesApi()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT_COMPLETIONS)


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, COMPLETIONS)


async def responses(request: web.Request) -> web.StreamResponse:
    return await generate(request, RESPONSES_API)


async def messages(request: web.Request) -> web.StreamResponse:
    return await generate(request, MESSAGES)


async def generate(request: web.Request, api: ClientApi, body: dict | None = None) -> web.StreamResponse:
    """body: one prompt of a completions batch (edge.http.completion_batch), already read."""
    gateway: Gateway = gateway_of(request)
    try:
        gateway.check_key(request)
        if gateway.embedding_only:
            raise generation_refused(gateway, request.path)
        body = await read_json(request, gateway) if body is None else body
        bodies = api.batch(body, gateway.pool.vocab_size, gateway.config.limits.prefill_queue_size)
    except ApiError as err:
        return _refused(request, gateway, api, err, None)
    if bodies is not None and body.get("stream"):  # one stream of every prompt's chunks
        return await _stream_batch(request, gateway, api, bodies)
    if bodies is not None:  # one request per prompt, each on this path
        return await serve_batch(bodies, lambda one: generate(request, api, one))
    try:
        run = await _admitted(request, gateway, api, body)
    except ApiError as err:
        return api.error(err)
    return await _answer(request, gateway, run, api)


async def _admitted(request: web.Request, gateway: Gateway, api: ClientApi, body) -> Run:
    """The body parsed, checked and admitted; a refusal is counted and heard by the observers, then raised."""
    parsed = None
    try:
        earlier = _earlier(request, api, body)
        parsed = api.parse(body, gateway.pool.vocab_size, await chat_format(gateway) if api.chat else None, earlier)
        gateway.check_model(parsed.model, request)  # before a structured output's compile
        await _check_structured(request, gateway, parsed)
        return gateway.admit(request, parsed)
    except ApiError as err:
        _refused(request, gateway, api, err, parsed)
        raise


def _refused(request: web.Request, gateway: Gateway, api: ClientApi, err: ApiError,
             parsed: GenerateRequest | None) -> web.Response:
    gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
    gateway.rejected(request, err, parsed)
    return api.error(err)


async def _check_structured(request: web.Request, gateway: Gateway, parsed: GenerateRequest) -> None:
    """The constraint compiled as the workers will compile it, under the salt whose compiles may answer it."""
    if parsed.sampling.structured is None:
        return
    config = gateway.config
    await check_structured(parsed, request.app[GRAMMAR_CHECKS], compile_timeout_s(config), model_path(gateway),
                           compile_owner(key_id(bearer_key(request)), request.remote),
                           config.grammar_compile_queue_per_key, gateway.cache_salt(request, parsed))


async def _answer(request: web.Request, gateway: Gateway, run: Run, api: ClientApi) -> web.StreamResponse:
    completion = Completion(run.inflight.request_id, run.request, gateway.model_name)
    ended = False
    try:
        response = await (stream(request, gateway, run, completion, api) if run.request.stream
                          else collect(gateway, run, completion, api))
        ended = True
        if completion.finish_reason in ("stop", "length"):
            _keep(request, api, completion)
        return response
    finally:  # an exception (the client went away): aborted
        status, reason = _ending(completion) if ended else (RequestStatus.ABORTED, "abort")
        await asyncio.shield(gateway.end(run, status, reason, completion.usage, completion.error))


async def _stream_batch(request: web.Request, gateway: Gateway, api: ClientApi,
                        bodies: list[dict]) -> web.StreamResponse:
    """A streamed batch: every prompt admitted on this path (one refused: the others end, aborted, and the answer
    is its refusal), then their chunks in one stream (edge.http.completion_batch), then each one's terminal state."""
    runs: list[Run] = []
    try:
        for body in bodies:
            runs.append(await _admitted(request, gateway, api, body))
    except ApiError as err:
        await asyncio.shield(asyncio.gather(*(gateway.end(run, RequestStatus.ABORTED, "abort") for run in runs)))
        return api.error(err)
    completions = [Completion(run.inflight.request_id, run.request, gateway.model_name) for run in runs]
    ended = False
    try:
        response = await stream_batch(request, gateway, runs, completions, api)
        ended = True
        return response
    finally:  # an exception (the client went away): every prompt aborted
        await asyncio.shield(asyncio.gather(*(
            gateway.end(run, *(_ending(c) if ended else (RequestStatus.ABORTED, "abort")), c.usage, c.error)
            for run, c in zip(runs, completions, strict=True))))


def _ending(completion: Completion) -> tuple[RequestStatus, str]:
    """The terminal state of an answer that went out (or was refused after admission): finished, failed (its own
    error) or aborted (ended by the server, or cut off by another prompt's error in a batch's stream)."""
    if completion.finish_reason in ("stop", "length"):
        return RequestStatus.FINISHED, completion.finish_reason
    if completion.error is not None and completion.error.code != "aborted":
        return RequestStatus.FAILED, "error"
    return RequestStatus.ABORTED, "abort"


def _earlier(request: web.Request, api: ClientApi, body) -> tuple[dict, ...]:
    """The stored conversation the body continues (Responses' previous_response_id), looked up under the request's
    API key: another key's, an expired or an unknown id is a 404."""
    previous = api.continues(body)
    if previous is None:
        return ()
    items = request.app[RESPONSES].get(key_id(bearer_key(request)) or "", previous)
    if items is None:
        raise ApiError(404, f"previous response {previous!r} not found (unknown, expired, deleted, or made with "
                            f"another API key)", "previous_response_id", "previous_response_not_found")
    return items


def _keep(request: web.Request, api: ClientApi, completion: Completion) -> None:
    if (kept := api.stored(completion)) is not None:
        request.app[RESPONSES].put(key_id(bearer_key(request)) or "", *kept)


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: a stored response of this key forgotten; else a 404."""
    gateway: Gateway = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    try:
        gateway.check_key(request)
        if not request.app[RESPONSES].delete(key_id(bearer_key(request)) or "", response_id):
            raise ApiError(404, f"response {response_id!r} not found", "response_id", "response_not_found")
    except ApiError as err:
        return RESPONSES_API.error(err)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})
