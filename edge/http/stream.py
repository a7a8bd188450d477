"""An admitted request's answer, for every client API (edge.api.client_api): collected into one body, or streamed as
the API's server-sent events. Either way the answer's headers wait for the first engine event, so a request that
fails before it produced anything keeps its HTTP status and the API's error body; after the headers an error travels
in the stream, then the stream ends."""

from __future__ import annotations

from aiohttp import web

from edge.api.client_api import ClientApi
from edge.api.completion import Completion
from edge.api.openai_request import ApiError
from edge.core.gateway import Gateway, Run

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def collect(gateway: Gateway, run: Run, completion: Completion, api: ClientApi) -> web.Response:
    try:
        while completion.finish_reason is None:
            added(completion, run, await gateway.next_event(run))
    except ApiError as err:
        completion.error = err
        return with_headers(api.error(err), run)
    return web.json_response(api.body(completion), headers=run.headers)


async def stream(request: web.Request, gateway: Gateway, run: Run, completion: Completion,
                 api: ClientApi) -> web.StreamResponse:
    try:
        event = await gateway.next_event(run)
    except ApiError as err:
        completion.error = err
        return with_headers(api.error(err), run)
    response = web.StreamResponse(headers={**SSE_HEADERS, **run.headers})
    await response.prepare(request)
    writer = api.writer(completion)
    opened = False
    try:
        while True:
            added(completion, run, event)
            if not opened:
                await response.write(writer.open())
                opened = True
            await response.write(writer.event(completion.delta(event)))
            if completion.finish_reason is not None:
                break
            event = await gateway.next_event(run)
        await response.write(writer.close())
    except ApiError as err:
        completion.finish_reason, completion.error = None, err
        await response.write((b"" if opened else writer.open()) + writer.error(err))
    await response.write_eof()
    return response


def added(completion: Completion, run: Run, event) -> None:
    """The event added; the worker's report (prompt scores, cached tokens) comes before any token."""
    completion.prompt_scores, completion.cached_tokens = run.prompt_logprobs, run.cached_tokens
    completion.add(event)


def with_headers(response: web.Response, run: Run) -> web.Response:
    response.headers.update(run.headers)
    return response
