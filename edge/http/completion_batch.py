"""A completions request with a list of prompts (strings or token lists; edge.api.completions checks them), as
OpenAI and vLLM take it: one request per prompt through the same gateway path (key, policy, queue, priority, quota,
audit line, one terminal state each), and one answer whose choices are prompt-major (prompt i's n choices at indexes
i*n .. i*n+n-1) and whose usage is the sum of theirs."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


async def serve_batch(bodies: list[dict], generate) -> web.StreamResponse:
    """generate(body) answers one prompt's body (edge.http.generate's path). The first failed prompt's error is the
    answer (every prompt still ended in its own terminal state); otherwise the joined completion."""
    answers = await asyncio.gather(*(generate(body) for body in bodies))
    failed = next((answer for answer in answers if answer.status != 200), None)
    if failed is not None:
        return failed
    return web.json_response(join(bodies[0], [json.loads(answer.body) for answer in answers]),
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
