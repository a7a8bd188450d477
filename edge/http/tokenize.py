"""POST /tokenize and POST /detokenize, in vLLM's shape.

    /tokenize   {model, prompt, add_special_tokens = true}  or  {model, messages, tools?, add_special_tokens}
                -> {count, max_model_len, tokens, token_strs: null}
    /detokenize {model, tokens} -> {prompt}

The tokens are the ones a prefill worker would prefill: the same PromptRenderer (the GGUF's chat template, its
BOS rule for completions) over the GGUF's tokenizer alone, which llama.cpp loads without the weights, in the
gateway, in a thread off the event loop. Only the API key is checked: no model runs, so no queue or quota.

The gateway holds one such Tokenizer per GGUF (edge.http.tokenizers, under edge.state.TOKENIZERS), built on first
use: these routes and the Anthropic Messages count_tokens route load the vocabulary once between them.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from edge.api.fields import ApiError, checked_text, get_field, show
from edge.api.openai_request import parse_request
from edge.core.gateway import Gateway
from edge.http.body import read_json
from edge.http.model_file import model_path
from edge.http.model_pick import gateway_of
from edge.http.tokenizers import Tokenizer
from edge.state import TOKENIZERS

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize body (the body's byte limit bounds it too)


def _checked_model(body, gateway: Gateway, request: web.Request) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = checked_text(get_field(body, "model", str, default=gateway.model_name), "model")
    gateway.check_model(model, request)


async def tokenize(request: web.Request) -> web.Response:
    gateway: Gateway = gateway_of(request)
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        _checked_model(body, gateway, request)
        tokenizer = request.app[TOKENIZERS].get(model_path(gateway))
        if body.get("messages") is not None:
            add_special = get_field(body, "add_special_tokens", bool, default=False)
            if add_special or get_field(body, "add_generation_prompt", bool, default=True) is False:
                raise ApiError(400, "messages are rendered as a worker renders them: by the chat template, which "
                                    "writes the special tokens and the generation prompt itself; leave "
                                    "'add_special_tokens' and 'add_generation_prompt' out", "add_special_tokens",
                               "unsupported_parameter")
            chat = parse_request({"model": gateway.model_name, "messages": body["messages"],
                                  "tools": body.get("tools")}, "chat")
            messages = [{"role": m["role"], "content": m["content"]} for m in chat.messages]  # as a PrefillJob
            tokens = await asyncio.to_thread(_rendered, tokenizer, messages)
        else:
            prompt = checked_text(get_field(body, "prompt", str, required=True), "prompt")
            add_special = get_field(body, "add_special_tokens", bool, default=True)
            tokens = await asyncio.to_thread(tokenizer.completion, prompt, add_special)
    except ApiError as err:
        gateway.rejected(request, err, None)
        return err.response()
    return web.json_response({"count": len(tokens), "max_model_len": gateway.config.max_model_len,
                              "tokens": tokens, "token_strs": None})


def _rendered(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    from prefill_cpu.prompt_renderer import BadPromptError
    try:
        return tokenizer.chat(messages)
    except BadPromptError as err:
        raise ApiError(400, str(err), "messages", "invalid_prompt") from None


async def detokenize(request: web.Request) -> web.Response:
    gateway: Gateway = gateway_of(request)
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        _checked_model(body, gateway, request)
        tokens = get_field(body, "tokens", list, required=True)
        if len(tokens) > MAX_DETOKENIZE:
            raise ApiError(400, f"'tokens' may hold at most {MAX_DETOKENIZE} ids, got {len(tokens)}", "tokens",
                           "invalid_value")
        if (bad := next((i for i, t in enumerate(tokens) if not isinstance(t, int) or isinstance(t, bool)),
                        None)) is not None:
            raise ApiError(400, f"tokens[{bad}] must be an integer token id, not {show(tokens[bad])}",
                           f"tokens[{bad}]", "invalid_type")
        prompt = await asyncio.to_thread(request.app[TOKENIZERS].get(model_path(gateway)).detokenize, tokens)
    except ApiError as err:
        gateway.rejected(request, err, None)
        return err.response()
    return web.json_response({"prompt": prompt})
