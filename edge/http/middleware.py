"""One error body for every failure: aiohttp's own 404, 405 and 413 and any unexpected exception answer in
the OpenAI shape ({"error": {"message", "type", "param", "code"}}) instead of aiohttp's plain text, so
OpenAI clients can read every error the same way; under /v1/messages in Anthropic's shape, under /api/ in Ollama's."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from edge.api.messages import error_response as anthropic_error
from edge.api.ollama import error_response as ollama_error
from edge.api.openai_request import ApiError

log = logging.getLogger("edge.http")
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
DROPPED_HEADERS = {"content-type", "content-length"}  # describe aiohttp's text body, not ours


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as exc:
        if _answered(request) or isinstance(exc, ConnectionResetError) or \
                (isinstance(exc, web.HTTPException) and exc.status < 400):  # redirects are not errors
            raise  # nobody to answer, or a stream's headers already left: aiohttp closes the connection
        err = _as_api_error(request, exc)
        if request.path.startswith("/v1/messages"):  # the Anthropic routes answer in Anthropic's shape
            return anthropic_error(err)
        if request.path.startswith("/api/"):  # Ollama's routes (and an unknown /api/ path) answer in its shape
            return ollama_error(err)
        return err.response()


def _answered(request: web.Request) -> bool:
    return request.writer is not None and request.writer.output_size > 0


def _as_api_error(request: web.Request, exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, web.HTTPException):
        return _from_http(request, exc)
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's own answer to a handler timing out is a 504
        return ApiError(504, "the server timed out on this request", error_type="server_error", code="timeout")
    log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
    return ApiError(500, "the server failed on this request; its log has the details", error_type="server_error",
                    code="internal_error")


def _from_http(request: web.Request, exc: web.HTTPException) -> ApiError:
    headers = {k: v for k, v in exc.headers.items() if k.lower() not in DROPPED_HEADERS}  # keeps Allow on a 405
    path = request.path[:200]
    if exc.status == 404:
        known = ", ".join(sorted({r.canonical for r in request.app.router.resources()}))
        message = f"there is no endpoint at {path}; this server has {known}"
    elif exc.status == 405:
        message = f"{request.method} is not allowed on {path}; use {exc.headers.get('Allow', '')}"
    else:
        message = exc.text or exc.reason
    return ApiError(exc.status, message, code=HTTP_CODES.get(exc.status, exc.reason.lower().replace(" ", "_")),
                    error_type="server_error" if exc.status >= 500 else "invalid_request_error", headers=headers)
