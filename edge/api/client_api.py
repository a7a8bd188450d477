"""A client API on the gateway's one generate path (edge.http.generate): how it reads a body into a GenerateRequest,
writes a finished Completion, streams its ChoiceDeltas and shapes an error. OpenAI chat completions and completions,
OpenAI Responses and Anthropic Messages are each one."""

from __future__ import annotations

import json

from aiohttp import web

from edge.api.completion import ChoiceDelta, Completion
from edge.api.openai_request import ApiError, GenerateRequest


class StreamWriter:
    """One stream's bytes. open() once the first engine event is added (the prompt's size is known then), event()
    for each engine event's delta (None: nothing to send), close() after the last, error() instead of close()."""

    def open(self) -> bytes:
        return b""

    def event(self, delta: ChoiceDelta | None) -> bytes:
        raise NotImplementedError

    def close(self) -> bytes:
        return b""

    def error(self, err: ApiError) -> bytes:
        raise NotImplementedError


class ClientApi:
    """route: the path, for metrics and the audit log. chat: the API takes messages, so the parser needs the model's
    ChatFormat (edge.chat.tool_formats)."""
    route = ""
    chat = True

    def parse(self, body, vocab_size: int | None, chat=None, earlier: tuple[dict, ...] = ()) -> GenerateRequest:
        """earlier: the stored conversation the body continues (continues()), as its items."""
        raise NotImplementedError

    def continues(self, body) -> str | None:
        """The id of a stored response the body continues (Responses' previous_response_id); None: none."""
        return None

    def stored(self, completion: Completion) -> tuple[str, tuple[dict, ...]] | None:
        """(the response's id, the items to keep) once answered, for an API whose answers a later request may
        continue (edge.api.response_store); None: nothing kept."""
        return None

    def batch(self, body, vocab_size: int | None, max_prompts: int) -> list | None:
        """The bodies of a request that asks for several answers at once (a completions batch), each checked before
        any is queued; None for one request."""
        return None

    def error(self, err: ApiError) -> web.Response:
        return err.response()

    def body(self, completion: Completion) -> dict:
        raise NotImplementedError

    def writer(self, completion: Completion) -> StreamWriter:
        raise NotImplementedError

    def batch_writer(self, completions: list[Completion]):
        """One stream of a batch's Completions (prompt-major choice indexes), for an API that takes batches."""
        raise NotImplementedError


def sse_event(name: str, data: dict) -> bytes:
    """A server-sent event with its name (the Responses and Anthropic streams name each event)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
