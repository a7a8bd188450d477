"""What a client API adds to the chat completions path: how it reads a body, writes an answer, streams events
and shapes an error; and the one streaming loop they share."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from aiohttp import web

from edge.api.openai_bodies import Completion
from edge.api.openai_request import ApiError, GenerateRequest

if TYPE_CHECKING:
    from edge.core.gateway import Gateway, Run


class StreamWriter:
    """One stream's events. open() once the first engine event is added (the prompt's size is known then),
    event() for each engine event after Completion.add, close() after the last, error() instead of close()."""

    def open(self) -> bytes:
        return b""

    def event(self, chunk: dict | None) -> bytes:
        raise NotImplementedError

    def close(self) -> bytes:
        return b""

    def error(self, err: ApiError) -> bytes:
        raise NotImplementedError


class ClientApi:
    """A client API on the gateway's path. route: the path, for metrics and the audit log."""
    route = ""

    def parse(self, body, vocab_size: int | None, chat=None) -> GenerateRequest:
        """chat: the model's ChatFormat (edge.chat.tool_formats), as parse_request takes it."""
        raise NotImplementedError

    def error(self, err: ApiError) -> web.Response:
        return err.response()

    def body(self, completion: Completion) -> dict:
        raise NotImplementedError

    def writer(self, completion: Completion) -> StreamWriter:
        raise NotImplementedError


def chat_delta(chunk: dict | None) -> tuple[dict, str | None]:
    """(delta, finish_reason) of a chat completion chunk (Completion.chunk); an empty delta for None."""
    if chunk is None:
        return {}, None
    choice = chunk["choices"][0]
    return choice["delta"], choice["finish_reason"]


def sse_event(name: str, data: dict) -> bytes:
    """A server-sent event with its name (the Responses and Anthropic streams name each event)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def stream(request: web.Request, gateway: Gateway, run: Run, completion: Completion,
                 api: ClientApi) -> web.StreamResponse:
    """The answer as the API's events. As on chat, the headers wait for the first engine event, so a request that
    fails before it produced anything keeps its HTTP status and the API's error body."""
    try:
        event = await gateway.next_event(run)
    except ApiError as err:
        completion.error = err
        response = api.error(err)
        response.headers.update(run.headers)
        return response
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **run.headers})
    await response.prepare(request)
    writer = api.writer(completion)
    opened = False
    try:
        while True:
            completion.add(event)
            completion.cached_tokens = run.cached_tokens  # the worker's report comes before the first token
            if not opened:
                await response.write(writer.open())
                opened = True
            await response.write(writer.event(completion.chunk(event)))
            if completion.finish_reason is not None:
                break
            event = await gateway.next_event(run)
        await response.write(writer.close())
    except ApiError as err:  # after the headers: the error travels in the stream, then it ends
        completion.finish_reason, completion.error = None, err
        await response.write((writer.open() if not opened else b"") + writer.error(err))
    await response.write_eof()
    return response
