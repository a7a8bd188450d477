"""HTTP routes: the OpenAI API, /health, /metrics and the operator's status page (/, /status, /status.json)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from aiohttp import BasicAuth, web

from contracts.grammar_compile import compile_timeout_s
from edge.api.client_api import ClientApi
from edge.api.client_api import stream as api_stream
from edge.api.fields import show
from edge.api.messages import MessagesApi, error_response, prompt_tokens
from edge.api.openai_bodies import Completion, sse
from edge.api.openai_request import ApiError, parse_request
from edge.api.responses import ResponsesApi
from edge.api.structured import check_structured, compile_owner, structured_state
from edge.chat.tool_formats import ChatFormat, chat_format_of
from edge.core.engine_group import EngineGroup
from edge.core.gateway import Gateway, Run, _bearer
from edge.core.lifecycle import RequestStatus
from edge.http import embeddings as embeddings_api
from edge.http import tokenize as tokenize_api
from edge.http.completion_batch import batch_prompts, check_batch, serve_batch
from edge.http.middleware import error_middleware
from edge.observe.status_board import LOGIN_PAGE, SESSION_COOKIE, SESSIONS, STATUS, StatusBoard, StatusSessions, page
from edge.state import GATEWAY, RELOADER, SUPERVISOR
from policies.quota import key_id

log = logging.getLogger("edge.http.routes")
NO_STORE = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}  # the status page and its session


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat", ResponsesApi())


async def messages(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat", MessagesApi())


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's count_tokens: the key checked, the prompt rendered and tokenized as a worker would, no model
    work (so no queue, priority or quota); answered in Anthropic's shape, audited and counted like the rest."""
    gateway: Gateway = request.app[GATEWAY]
    parsed = None
    try:
        gateway.check_key(request)
        parsed, tokens = await prompt_tokens(gateway, await _read_json(request, gateway), _model_path(gateway),
                                             await _chat_format(gateway, "chat"))
    except ApiError as err:
        gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
        gateway.rejected(request, err, parsed)
        return error_response(err)
    gateway.answered(request, parsed, tokens, "counted")
    return web.json_response({"input_tokens": tokens})


async def _generate(request: web.Request, kind: str, api: ClientApi | None = None,
                    body: dict | None = None) -> web.StreamResponse:
    """api: another client API (Responses, Anthropic Messages) translated onto this chat path (edge/apis/); body:
    one prompt of a completions batch (edge.http.completion_batch), already read."""
    gateway: Gateway = request.app[GATEWAY]
    parsed = None
    try:
        gateway.check_key(request)
        if getattr(gateway, "embedding_only", False):  # (a test's stub gateway may not say)
            raise embeddings_api.generation_refused(gateway, request.path)
        body = await _read_json(request, gateway) if body is None else body
        if kind == "completion" and (prompts := batch_prompts(body)) is not None:  # one request per prompt
            check_batch(body, prompts, gateway.pool.vocab_size, gateway.config.limits.prefill_queue_size)
            return await serve_batch(request, body, prompts, _generate)
        parsed = api.parse(body, gateway.pool.vocab_size, await _chat_format(gateway, kind)) if api else \
            parse_request(body, kind, vocab_size=gateway.pool.vocab_size, chat=await _chat_format(gateway, kind))
        await check_structured(parsed, compile_timeout_s(gateway.config), _model_path(gateway),
                               compile_owner(key_id(_bearer(request)), request.remote),
                               gateway.config.grammar_compile_queue_per_key, _cache_salt(gateway, request, parsed))
        run = gateway.admit(request, parsed)
    except ApiError as err:
        gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
        gateway.rejected(request, err, parsed)
        return api.error(err) if api else err.response()
    completion = Completion(run.inflight.request_id, run.request, gateway.model_name)
    status, reason = RequestStatus.ABORTED, "abort"
    try:
        if run.request.stream:
            response = await (api_stream(request, gateway, run, completion, api) if api
                              else _stream(request, gateway, run, completion))
        else:
            response = await _collect(gateway, run, completion, api)
        if completion.finish_reason in ("stop", "length"):
            status, reason = RequestStatus.FINISHED, completion.finish_reason
        elif completion.error is not None and completion.error.code != "aborted":
            status, reason = RequestStatus.FAILED, "error"
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        status, reason = RequestStatus.ABORTED, "abort"  # the client went away
        raise
    finally:
        await asyncio.shield(gateway.end(run, status, reason, completion.usage, completion.error))


async def _chat_format(gateway: Gateway, kind: str) -> ChatFormat | None:
    """The model's chat template as far as tools and reasoning go (read from its GGUF once, edge.chat.tool_formats)."""
    if kind != "chat":
        return None
    config = gateway.config
    return await chat_format_of(_model_path(gateway), getattr(config, "tool_call_parser", "auto"),
                                getattr(config, "reasoning_parser", "auto"))


def _cache_salt(gateway: Gateway, request: web.Request, parsed) -> str:
    """The salt whose compiles may answer the request's constraint (none without one: nothing to compile)."""
    return "" if parsed.sampling.get("structured") is None else gateway.cache_salt(request, parsed)


def _model_path(gateway: Gateway) -> str | None:
    """The GGUF the workers load, whose vocabulary the gateway compiles constraints over."""
    from prefill_cpu.embedded_model import embedded_model_path
    try:
        return getattr(gateway.config, "model", None) or embedded_model_path()
    except FileNotFoundError:
        return None


async def _read_json(request: web.Request, gateway: Gateway):
    limits = gateway.config.limits
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise ApiError(413, f"the body has {request.content_length} bytes, more than the limit of "
                            f"{limits.max_body_bytes}", code="body_too_large")
    try:
        raw = await asyncio.wait_for(request.read(), timeout=limits.body_timeout_s)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {limits.body_timeout_s:.0f} s",
                       code="body_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the body is larger than the limit of {limits.max_body_bytes} bytes",
                       code="body_too_large") from None
    try:
        return json.loads(raw)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer over Python's 4300 digits
        raise ApiError(400, f"the body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:  # json's C scanner bounds nesting by the recursion limit
        raise ApiError(400, "the body nests arrays and objects too deeply to parse; send a flatter JSON body",
                       code="invalid_json") from None


async def _collect(gateway: Gateway, run: Run, completion: Completion, api: ClientApi | None = None) -> web.Response:
    try:
        while completion.finish_reason is None:
            completion.add(await gateway.next_event(run))
            completion.prompt_scores = run.prompt_logprobs  # the worker sends it before any token
            completion.cached_tokens = run.cached_tokens
    except ApiError as err:
        completion.error = err
        return _with_headers(api.error(err) if api else err.response(), run)
    return web.json_response(api.body(completion) if api else completion.body(), headers=run.headers)


async def _stream(request: web.Request, gateway: Gateway, run: Run, completion: Completion) -> web.StreamResponse:
    try:
        first = await gateway.next_event(run)  # headers wait for the first token, so errors keep their status
    except ApiError as err:
        completion.error = err
        return _with_headers(err.response(), run)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **run.headers})
    await response.prepare(request)
    event = first
    try:
        while True:
            completion.prompt_scores, completion.cached_tokens = run.prompt_logprobs, run.cached_tokens
            completion.add(event)
            for chunk in completion.chunks(event):  # OpenAI's shape: a role chunk first, finish_reason alone last
                await response.write(sse(chunk))
            if completion.finish_reason is not None:
                break
            event = await gateway.next_event(run)
        if run.request.include_usage:
            await response.write(sse(completion.usage_chunk()))
    except ApiError as err:  # after the headers: the error travels in the stream, then it ends
        completion.finish_reason, completion.error = None, err
        await response.write(sse({"error": {"message": err.message, "type": err.error_type, "param": None,
                                            "code": err.code}}))
    await response.write(sse("[DONE]"))
    await response.write_eof()
    return response


def _with_headers(response: web.Response, run: Run) -> web.Response:
    response.headers.update(run.headers)
    return response


async def embeddings(request: web.Request) -> web.Response:
    return await embeddings_api.embeddings(request, _read_json)


async def rerank(request: web.Request) -> web.Response:
    return await embeddings_api.rerank(request, _read_json)


async def tokenize(request: web.Request) -> web.Response:
    return await tokenize_api.tokenize(request, _read_json, _model_path(request.app[GATEWAY]))


async def detokenize(request: web.Request) -> web.Response:
    return await tokenize_api.detokenize(request, _read_json, _model_path(request.app[GATEWAY]))


async def models(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY]
    try:
        gateway.check_key(request)
    except ApiError as err:
        return err.response()
    return web.json_response({"object": "list", "data": [_model_card(gateway.model_name, gateway)]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (the openai client's models.retrieve): the served model's card, else a 404."""
    gateway: Gateway = request.app[GATEWAY]
    name = request.match_info["model_id"]
    try:
        gateway.check_key(request)
        if name != gateway.model_name:
            raise ApiError(404, f"the model {show(name)} does not exist here (this server serves "
                                f"{gateway.model_name})", "model", "model_not_found")
    except ApiError as err:
        return err.response()
    return web.json_response(_model_card(name, gateway))


def _model_card(name: str, gateway: Gateway) -> dict:
    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "edge"}
    return {**card, **embeddings_api.model_facts(gateway)}


async def health(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY]
    group = gateway.engine if isinstance(gateway.engine, EngineGroup) else None
    # each engine of a group by name (a down one makes the service degraded), else the one engine
    components = {name: c.state for name, c in group.clients.items()} if group else {}
    components = components or ({} if gateway.embedding_only else {"decode_engine": gateway.engine.state})
    components.update({name: w.state for name, w in gateway.pool.workers.items()})
    supervisor = request.app.get(SUPERVISOR)
    processes = supervisor.snapshot() if supervisor else {}
    ready = gateway.ready and not gateway.shutting_down
    troubled = any(p["state"] in ("backoff", "crash_loop") for p in processes.values())
    degraded = ready and (troubled or any(state != "ready" for state in components.values()))
    body = {"status": "degraded" if degraded else "ok" if ready else "loading" if not gateway.shutting_down
            else "shutting_down", "model": gateway.model_name, "components": components, "processes": processes,
            "errors": _component_errors(gateway), "prefill": _prefill_state(gateway),
            "prefill_queue": gateway.pool.queue_length, "policy": _policy_state(request),
            "engine": dataclasses.asdict(gateway.engine.stats) if gateway.engine.stats else None,
            "structured_outputs": structured_state(), **embeddings_api.model_facts(gateway)}
    if group is not None:
        body["engines"] = _engine_state(group)
    return web.json_response(body, status=200 if ready else 503)


def _engine_state(group: EngineGroup) -> dict:
    """Each decode engine of a group: where it is, its state, what the gateway sent it, what it last reported."""
    engines = {}
    for name, client in group.clients.items():
        stats = client.stats
        engines[name] = {"state": client.state, "address": client.address, "requests": group.num_requests(name),
                         "running": stats.num_running if stats else None,
                         "waiting": stats.num_waiting if stats else None,
                         "kv_usage": round(stats.kv_blocks_used / stats.kv_blocks_total, 4)
                         if stats and stats.kv_blocks_total else None}
    return engines


def _component_errors(gateway: Gateway) -> dict:
    """Why a component is not ready (a refused handshake, a bad frame, a missed heartbeat), if known."""
    clients = gateway.engine.clients if isinstance(gateway.engine, EngineGroup) else {}
    errors = {name: c.last_error for name, c in clients.items()} or \
        ({} if gateway.embedding_only else {"decode_engine": gateway.engine.last_error})
    errors.update({name: w.last_error for name, w in gateway.pool.workers.items()})
    return {name: error for name, error in errors.items() if error}


def _prefill_state(gateway: Gateway) -> dict:
    return {name: {"request": w.current_id, "stuck_count": w.stuck_count,
                   "engine_connected": w.engine_connected, "weights": w.info.prefill_weights if w.info else None}
            for name, w in gateway.pool.workers.items()}


def _policy_state(request: web.Request) -> dict:
    gateway: Gateway = request.app[GATEWAY]
    state = gateway.enforcer.evaluator.state
    reloader = request.app.get(RELOADER)
    return {"source": gateway.enforcer.policy.source, "tier": state.name, "reason": state.reason,
            "in_tier_s": round(gateway.enforcer.clock() - state.since, 1),
            "last_reload_error": reloader.last_error if reloader else None}


async def metrics(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY]
    gateway.refresh_metrics()
    return web.Response(body=gateway.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def status_page(request: web.Request) -> web.Response:
    """The page, for an admin: a key sent with the load (basic auth, a bearer header) opens a session whose cookie
    lets the page's polls in; without one, a browser asks for the key (basic auth) or shows the sign-in form."""
    try:
        key, token = _admin_key(request, challenge=True)
    except ApiError as err:
        if err.status != 401 or "text/html" not in request.headers.get("Accept", ""):
            raise
        return web.Response(status=401, text=LOGIN_PAGE, content_type="text/html",
                            headers={**NO_STORE, **(err.headers or {})})  # a browser: its dialog, else the form
    response = web.Response(text=page(), content_type="text/html", headers=NO_STORE)
    if key is not None and token is None:
        sessions = request.app[SESSIONS]
        sessions.set_cookie(response, sessions.start(key), request.secure)
    return response


async def status_login(request: web.Request) -> web.Response:
    """POST /status/login (form field `key`, or a bearer header): a session cookie for an admin key, then the page."""
    form = await request.post()
    key = form.get("key") if isinstance(form.get("key"), str) else _sent_key(request)
    _check_admin(request, key, challenge=False)
    response = web.Response(status=303, headers={**NO_STORE, "Location": "/status"})
    sessions = request.app[SESSIONS]
    sessions.set_cookie(response, sessions.start(key or ""), request.secure)
    return response


async def status_logout(request: web.Request) -> web.Response:
    request.app[SESSIONS].end(request.cookies.get(SESSION_COOKIE))
    response = web.Response(status=303, headers={**NO_STORE, "Location": "/status"})
    response.del_cookie(SESSION_COOKIE, path="/")
    return response


async def status_json(request: web.Request) -> web.Response:
    _admin_key(request, challenge=False)
    board = request.app.get(STATUS)
    if board is None:
        raise ApiError(503, "the status board is not running", error_type="server_error", code="unavailable")
    try:
        since = float(request.query.get("since", "0"))
    except ValueError:
        raise ApiError(400, "since must be a number (epoch seconds)", "since", "invalid_value") from None
    return web.json_response(board.snapshot(since), headers=NO_STORE)


def _admin_key(request: web.Request, challenge: bool) -> tuple[str | None, str | None]:
    """(the admin key, the session token it came by, or None): the key of the request's live status session, else
    one sent as a bearer token or as the password of HTTP basic auth (what a browser can send on a page load); its
    rule must have admin = true in the policy in force. (None, None) when the policy has no keys: then the page
    is open, as the API is. challenge: make a browser ask for the key (not on the JSON polls, where a dialog
    would pop up on every refused poll)."""
    if not request.app[GATEWAY].enforcer.policy.keys:
        return None, None
    token = request.cookies.get(SESSION_COOKIE)
    key = request.app[SESSIONS].key(token)
    if key is None:
        key, token = _sent_key(request), None
    _check_admin(request, key, challenge)
    return key, token


def _check_admin(request: web.Request, key: str | None, challenge: bool) -> None:
    rule = request.app[GATEWAY].enforcer.policy.keys.get(key or "")
    if rule is None:
        headers = {"WWW-Authenticate": 'Basic realm="edge status", charset="UTF-8"'} if challenge else {}
        raise ApiError(401, "the status page needs an admin API key: 'Authorization: Bearer <key>', or basic auth "
                            "with the key as the password", error_type="authentication_error",
                       code="invalid_api_key", headers=headers)
    if not getattr(rule, "admin", False):
        raise ApiError(403, "this API key may not see the status page (its policy rule has no admin = true)",
                       error_type="permission_error", code="not_admin")


def _sent_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    try:
        return BasicAuth.decode(header).password if header else None
    except ValueError:  # not basic auth, or not base64
        return None


def add_routes(app: web.Application) -> None:
    app.middlewares.append(error_middleware)  # aiohttp's own errors (404, 405, 413) in the OpenAI shape too
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)  # ids may hold a slash (org/name)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/rerank", rerank)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", status_page)
    app.router.add_get("/status", status_page)
    app.router.add_get("/status.json", status_json)
    app.router.add_post("/status/login", status_login)
    app.router.add_post("/status/logout", status_logout)
    app[SESSIONS] = StatusSessions()
    gateway = app.get(GATEWAY)
    if isinstance(gateway, Gateway):  # a test's stub gateway has nothing to sample
        app[STATUS] = board = StatusBoard(gateway, app.get(SUPERVISOR), app.get(RELOADER))
        app.cleanup_ctx.append(board.running)
