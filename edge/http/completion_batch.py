"""A completions request with a list of prompts (strings or token lists), as OpenAI and vLLM take it: one request per
prompt through the same gateway path (key, policy, queue, priority, quota, audit line, one terminal state each),
and one answer whose choices are prompt-major (prompt i's n choices at indexes i*n .. i*n+n-1) and whose usage is
the sum of theirs."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from edge.api.fields import ApiError
from edge.api.openai_request import parse_request


def batch_prompts(body) -> list | None:
    """The prompts of a batch (two or more strings or token lists); None for a single prompt, which the one-request
    path takes (and types)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return None


def check_batch(body: dict, prompts: list, vocab_size: int | None, max_prompts: int) -> None:
    """Every prompt checked before any is queued, so that a bad one costs the others nothing."""
    if len(prompts) > max_prompts:
        raise ApiError(400, f"'prompt' holds {len(prompts)} prompts; a batch may hold at most {max_prompts} (the "
                            "prefill queue's size)", "prompt", "invalid_value")
    if body.get("stream"):
        raise ApiError(400, "'stream' with a batch of prompts is not supported here: stream one prompt per "
                            "request, or leave 'stream' out", "stream", "unsupported_parameter")
    for i, prompt in enumerate(prompts):
        try:
            parse_request({**body, "prompt": prompt}, "completion", vocab_size=vocab_size)
        except ApiError as err:
            param = err.param or ""
            param = f"prompt[{i}]{param[len('prompt'):]}" if param.startswith("prompt") else param or None
            raise ApiError(err.status, f"prompt[{i}]: {err.message}", param, err.code, err.error_type,
                           err.headers) from None


async def serve_batch(request: web.Request, body: dict, prompts: list, generate) -> web.StreamResponse:
    """generate(request, kind, body=...) answers one prompt (edge.http.routes' path). The first failed prompt's error is
    the answer (every prompt still ended in its own terminal state); otherwise the joined completion."""
    answers = await asyncio.gather(*(generate(request, "completion", body={**body, "prompt": prompt})
                                     for prompt in prompts))
    failed = next((answer for answer in answers if answer.status != 200), None)
    if failed is not None:
        return failed
    return web.json_response(join(body, [json.loads(answer.body) for answer in answers]),
                             headers=batch_headers(answers))


def join(body: dict, answers: list[dict]) -> dict:
    n = body.get("n") or 1
    choices = [{**choice, "index": i * n + choice["index"]} for i, answer in enumerate(answers)
               for choice in answer["choices"]]
    usage = {key: sum(answer["usage"][key] for answer in answers)
             for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for answer in answers)
    joined = {**answers[0], "choices": sorted(choices, key=lambda c: c["index"]),
              "usage": {**usage, "prompt_tokens_details": {"cached_tokens": cached}}}
    degraded = [answer["degraded"] for answer in answers if "degraded" in answer]
    if degraded:
        joined["degraded"] = degraded[0]
    return joined


def batch_headers(answers: list[web.Response]) -> dict[str, str]:
    """The first prompt's policy headers, and every prompt's request id."""
    headers = {k: v for k, v in answers[0].headers.items() if k.lower().startswith("x-")}
    headers["X-Request-Id"] = ", ".join(answer.headers.get("X-Request-Id", "") for answer in answers)
    return headers
