"""A request's JSON body, read under the size and time limits (Limits.max_body_bytes, body_timeout_s)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from edge.api.fields import ApiError
from edge.core.gateway import Gateway

BODY = web.RequestKey("body", object)  # a body read already (edge.http.model_pick reads it for its model)


async def read_json(request: web.Request, gateway: Gateway):
    if BODY in request:
        return request[BODY]
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
