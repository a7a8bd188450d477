"""POST /tokenize and POST /detokenize, in vLLM's shape.

    /tokenize   {model, prompt, add_special_tokens = true}  or  {model, messages, tools?, add_special_tokens}
                -> {count, max_model_len, tokens, token_strs: null}
    /detokenize {model, tokens} -> {prompt}

The tokens are the ones a prefill worker would prefill: the same PromptRenderer (the GGUF's chat template, its
BOS rule for completions) over the GGUF's tokenizer alone, which llama.cpp loads without the weights, in the
gateway, in a thread off the event loop. Only the API key is checked: no model runs, so no queue or quota.

The gateway holds one such Tokenizer per GGUF (shared_tokenizer), built on first use: these routes and the
Anthropic Messages count_tokens route (edge.api.messages) load the vocabulary once between them.
"""

from __future__ import annotations

import asyncio
import threading
import types

from aiohttp import web

from edge.api.fields import ApiError, checked_text, get_field, show
from edge.api.openai_request import parse_request
from edge.core.gateway import Gateway
from edge.state import GATEWAY

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize body (the body's byte limit bounds it too)


class Tokenizer:
    """The GGUF's tokenizer and chat template, loaded on first use; one caller at a time (llama.cpp's vocab)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._lock = threading.Lock()
        self._llm = None
        self._renderer = None

    def _load(self) -> None:
        if self._llm is None:
            import llama_cpp

            from prefill_cpu.prompt_renderer import PromptRenderer
            self._llm = llama_cpp.Llama(self.model_path, vocab_only=True, verbose=False)
            self._renderer = PromptRenderer(types.SimpleNamespace(llm=self._llm))

    def completion(self, prompt: str, add_special: bool) -> list[int]:
        with self._lock:
            self._load()
            if add_special:  # as a worker tokenizes a completion prompt
                return self._renderer.completion_tokens(prompt)
            return self._llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)

    def chat(self, messages: list[dict], tools: str = "") -> list[int]:
        """messages as a worker gets them (edge.api.messages.worker_messages); tools: JSON text."""
        with self._lock:
            self._load()
            return self._renderer.chat_tokens(messages, tools)

    def detokenize(self, tokens: list[int]) -> str:
        with self._lock:
            self._load()
            n_vocab = self._llm.n_vocab()
            if (bad := next((i for i, t in enumerate(tokens) if not 0 <= t < n_vocab), None)) is not None:
                raise ApiError(400, f"tokens[{bad}] is {tokens[bad]}, not a token id (0 to {n_vocab - 1})",
                               f"tokens[{bad}]", "invalid_value")
            return self._llm.detokenize(tokens, special=True).decode("utf-8", errors="replace")


_TOKENIZERS: dict[str, Tokenizer] = {}


def shared_tokenizer(model_path: str | None, what: str = "tokenize") -> Tokenizer:
    """The gateway's one Tokenizer for this GGUF (its vocabulary loads on first use). what: the work that needs it,
    for the 503 when the gateway does not know the model's file."""
    if model_path is None:
        raise ApiError(503, f"the model's file is not known to the gateway, so it cannot {what}",
                       error_type="server_error", code="unavailable")
    tokenizer = _TOKENIZERS.get(model_path)
    if tokenizer is None:
        tokenizer = _TOKENIZERS[model_path] = Tokenizer(model_path)
    return tokenizer


def _checked_model(body, gateway: Gateway) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = checked_text(get_field(body, "model", str, default=gateway.model_name), "model")
    if model != gateway.model_name:
        raise ApiError(404, f"the model {show(model)} is not served here (this server serves {gateway.model_name})",
                       "model", "model_not_found")


async def tokenize(request: web.Request, read_json, model_path: str | None) -> web.Response:
    gateway: Gateway = request.app[GATEWAY]
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        _checked_model(body, gateway)
        tokenizer = shared_tokenizer(model_path)
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


async def detokenize(request: web.Request, read_json, model_path: str | None) -> web.Response:
    gateway: Gateway = request.app[GATEWAY]
    try:
        gateway.check_key(request)
        body = await read_json(request, gateway)
        _checked_model(body, gateway)
        tokens = get_field(body, "tokens", list, required=True)
        if len(tokens) > MAX_DETOKENIZE:
            raise ApiError(400, f"'tokens' may hold at most {MAX_DETOKENIZE} ids, got {len(tokens)}", "tokens",
                           "invalid_value")
        if (bad := next((i for i, t in enumerate(tokens) if not isinstance(t, int) or isinstance(t, bool)),
                        None)) is not None:
            raise ApiError(400, f"tokens[{bad}] must be an integer token id, not {show(tokens[bad])}",
                           f"tokens[{bad}]", "invalid_type")
        prompt = await asyncio.to_thread(shared_tokenizer(model_path).detokenize, tokens)
    except ApiError as err:
        gateway.rejected(request, err, None)
        return err.response()
    return web.json_response({"prompt": prompt})
