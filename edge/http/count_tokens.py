"""POST /v1/messages/count_tokens (Anthropic's): the key checked, the prompt rendered and tokenized as a worker would,
no model work (so no queue, priority or quota); answered in Anthropic's shape, audited and counted like the rest."""

from __future__ import annotations

import asyncio

from aiohttp import web

from edge.api.messages import error_response, parse_count, worker_messages
from edge.api.openai_request import ApiError, GenerateRequest
from edge.core.gateway import Gateway
from edge.http.body import read_json
from edge.http.model_file import chat_format, model_path
from edge.http.model_pick import gateway_of
from edge.http.tokenizers import Tokenizers
from edge.state import TOKENIZERS


async def count_tokens(request: web.Request) -> web.Response:
    gateway: Gateway = gateway_of(request)
    parsed = None
    try:
        gateway.check_key(request)
        parsed = parse_count(await read_json(request, gateway), await chat_format(gateway))
        gateway.check_model(parsed.model, request)
        tokens = await prompt_tokens(request.app[TOKENIZERS], gateway, parsed)
    except ApiError as err:
        gateway.metrics.label(gateway.metrics.rejected, reason=err.code or str(err.status)).inc()
        gateway.rejected(request, err, parsed)
        return error_response(err)
    gateway.answered(request, parsed, tokens, "counted")
    return web.json_response({"input_tokens": tokens})


async def prompt_tokens(tokenizers: Tokenizers, gateway: Gateway, parsed: GenerateRequest) -> int:
    """The tokens of the request's prompt, from the gateway's tokenizer of the served GGUF (the one /tokenize uses)."""
    from prefill_cpu.prompt_renderer import BadPromptError
    tokenizer = tokenizers.get(model_path(gateway), "count tokens")
    try:
        return len(await asyncio.to_thread(tokenizer.chat, worker_messages(parsed), parsed.template_tools))
    except BadPromptError as err:
        raise ApiError(400, str(err), "messages", "invalid_prompt") from None
