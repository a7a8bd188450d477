"""A completions request with a list of prompts (strings or token lists; edge.api.completions checks them), as
OpenAI and vLLM take it: one request per prompt through the same gateway path (key, policy, queue, priority, quota,
audit line, one terminal state each), and one answer whose choices are prompt-major (prompt i's n choices at indexes
i*n .. i*n+n-1) and whose usage is the sum of theirs. Streamed, one stream carries every prompt's chunks as they
come, each with its choice's index in that order."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from edge.api.client_api import ClientApi
from edge.api.completion import Completion
from edge.api.openai_bodies import summed_usage
from edge.api.openai_request import ApiError
from edge.core.gateway import Gateway, Run
from edge.http.stream import SSE_HEADERS, added


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
    joined = {**answers[0], "choices": sorted(choices, key=lambda c: c["index"]),
              "usage": summed_usage([answer["usage"] for answer in answers])}
    degraded = [answer["degraded"] for answer in answers if "degraded" in answer]
    if degraded:
        joined["degraded"] = degraded[0]
    return joined


def batch_headers(answers: list[web.Response]) -> dict[str, str]:
    """The first prompt's policy headers, and every prompt's request id."""
    headers = {k: v for k, v in answers[0].headers.items() if k.lower().startswith("x-")}
    headers["X-Request-Id"] = ", ".join(answer.headers.get("X-Request-Id", "") for answer in answers)
    return headers


async def stream_batch(request: web.Request, gateway: Gateway, runs: list[Run], completions: list[Completion],
                       api: ClientApi) -> web.StreamResponse:
    """The admitted prompts' events, written as they come (one next_event waited for per prompt still running).
    As for one prompt (edge.http.stream), the headers wait for the first event: a failure before any keeps its
    HTTP status and error body; after them, a failure ends the stream with the error chunk (the prompts still
    running are then aborted by the caller, each in its own terminal state)."""
    writer = api.batch_writer(completions)
    waiting = {_next(gateway, run): i for i, run in enumerate(runs)}
    response: web.StreamResponse | None = None
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            failed: tuple[int, BaseException] | None = None
            for task in sorted(done, key=waiting.get):  # events that came together go out in prompt order
                i = waiting.pop(task)
                if (err := task.exception()) is not None:
                    failed = failed or (i, err)
                    continue
                event, completion = task.result(), completions[i]
                added(completion, runs[i], event)
                if response is None:
                    response = web.StreamResponse(headers={**SSE_HEADERS, **run_headers(runs)})
                    await response.prepare(request)
                await response.write(writer.event(i, completion.delta(event)))
                if completion.finish_reason is None:
                    waiting[_next(gateway, runs[i])] = i
            if failed is not None:
                i, err = failed
                if not isinstance(err, ApiError):
                    raise err
                completions[i].finish_reason, completions[i].error = None, err
                if response is None:
                    return _with_run_headers(api.error(err), runs)
                await response.write(writer.error(err))
                break
        else:
            await response.write(writer.close())
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    await response.write_eof()
    return response


def _next(gateway: Gateway, run: Run) -> asyncio.Task:
    return asyncio.ensure_future(gateway.next_event(run))


def run_headers(runs: list[Run]) -> dict[str, str]:
    """The first prompt's policy headers, and every prompt's request id."""
    return {**runs[0].headers, "X-Request-Id": ", ".join(run.inflight.request_id for run in runs)}


def _with_run_headers(response: web.Response, runs: list[Run]) -> web.Response:
    response.headers.update(run_headers(runs))
    return response
