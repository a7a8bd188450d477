"""The route table: every HTTP route and the handler that answers it (generation in edge.http.generate, the rest
each in its own module), the error middleware, and the application state the handlers share."""

from __future__ import annotations

from aiohttp import web

from edge.api.response_store import ResponseStore
from edge.api.structured import GrammarChecks
from edge.http import embeddings, generate, health, kv_cache, models, ollama, status_page, tokenize
from edge.http.count_tokens import count_tokens
from edge.http.middleware import error_middleware
from edge.http.model_pick import per_model
from edge.http.tokenizers import Tokenizers
from edge.observe.status_board import SESSIONS, STATUS, StatusBoard, StatusSessions
from edge.state import GATEWAY, GRAMMAR_CHECKS, MODELS, RELOADER, RESPONSES, SUPERVISOR, TOKENIZERS


def add_routes(app: web.Application) -> None:
    """The routes of the app whose gateway is under GATEWAY (and its supervisor and policy reloader, if any)."""
    app.middlewares.append(error_middleware)  # aiohttp's own errors (404, 405, 413) in the OpenAI shape too
    app.router.add_post("/v1/chat/completions", per_model(generate.chat_completions))
    app.router.add_post("/v1/completions", per_model(generate.completions))
    app.router.add_post("/v1/responses", per_model(generate.responses))
    app.router.add_delete("/v1/responses/{response_id}", generate.delete_response)
    app.router.add_post("/v1/messages", per_model(generate.messages))
    app.router.add_post("/v1/messages/count_tokens", per_model(count_tokens))
    app.router.add_get("/v1/models", health.models)
    app.router.add_post("/v1/models/{model_id:.+}/load", models.load)  # operators, with [[models]] (issue 45)
    app.router.add_post("/v1/models/{model_id:.+}/unload", models.unload)
    app.router.add_get("/v1/models/{model_id:.+}", health.model)  # ids may hold a slash (org/name)
    app.router.add_post("/v1/embeddings", per_model(embeddings.embeddings))
    app.router.add_post("/v1/rerank", per_model(embeddings.rerank))
    app.router.add_post("/tokenize", per_model(tokenize.tokenize))
    app.router.add_post("/detokenize", per_model(tokenize.detokenize))
    app.router.add_get("/health", health.health)
    app.router.add_get("/metrics", health.metrics)
    app.router.add_delete("/v1/kv_cache", kv_cache.delete_tenant)
    app.router.add_get("/", status_page.status_page)
    app.router.add_get("/status", status_page.status_page)
    app.router.add_get("/status.json", status_page.status_json)
    app.router.add_post("/status/login", status_page.status_login)
    app.router.add_post("/status/logout", status_page.status_logout)
    ollama.add_routes(app)  # Ollama's /api/... for the clients that speak it
    app[SESSIONS] = StatusSessions()
    app[TOKENIZERS] = Tokenizers()
    if RESPONSES not in app:
        app[RESPONSES] = ResponseStore()
    if GRAMMAR_CHECKS not in app:  # edge.app gives its own and warms and closes it; an app without one gets one here
        app[GRAMMAR_CHECKS] = GrammarChecks()
        app.on_cleanup.append(lambda app: _closed(app[GRAMMAR_CHECKS]))
    app[STATUS] = board = StatusBoard(app[GATEWAY], app.get(SUPERVISOR), app.get(RELOADER), models=app.get(MODELS))
    app.cleanup_ctx.append(board.running)


async def _closed(checks: GrammarChecks) -> None:
    checks.close()
