"""POST /v1/responses (OpenAI Responses): the body is read by its own parser (edge.api.responses_request), and the
answer (edge.api.completion) becomes a response object and the Responses stream's semantic events. A response is
kept (edge.api.response_store) unless the body says `store: false`, so that a later request may continue it with
`previous_response_id`."""

from __future__ import annotations

import json
import time

from edge.api.client_api import ClientApi, StreamWriter, sse_event
from edge.api.completion import ChoiceDelta, Completion
from edge.api.fields import ApiError
from edge.api.generate_request import GenerateRequest
from edge.api.responses_request import parse_responses

# the request's fields that an error after parsing (the policy's, a prefill worker's) names, as Responses names them
AFTER_PARSE = {"messages": "input", "max_tokens": "max_output_tokens"}


class ResponsesApi(ClientApi):
    route = "/v1/responses"

    def parse(self, body, vocab_size: int | None, chat=None, earlier: tuple[dict, ...] = ()) -> GenerateRequest:
        return parse_responses(body, vocab_size, chat, earlier)

    def continues(self, body) -> str | None:
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        return previous if isinstance(previous, str) else None

    def stored(self, completion: Completion) -> tuple[str, tuple[dict, ...]] | None:
        request = completion.request
        if not request.store:
            return None
        return response_id(completion), (*request.history, *self.body(completion)["output"])

    def error(self, err: ApiError):
        return _renamed(err).response()

    def body(self, completion: Completion) -> dict:
        message, _ = completion.message(completion.choices[0])
        output = []
        rid = response_id(completion)
        if message.get("reasoning_content"):
            output.append(_reasoning_item(f"rs_{rid[5:]}", message["reasoning_content"]))
        if message.get("content"):
            output.append(_message_item(f"msg_{rid[5:]}", message["content"], "completed"))
        for i, call in enumerate(message.get("tool_calls") or ()):
            output.append(_call_item(f"fc_{rid[5:]}_{i}", call, "completed"))
        return response_object(completion, output)

    def writer(self, completion: Completion) -> StreamWriter:
        return ResponsesStream(completion)


def _renamed(err: ApiError) -> ApiError:
    """An error after parsing (an over-long prompt, the policy's token limit) names the Responses field."""
    theirs = AFTER_PARSE.get(err.param or "")
    if theirs is None:
        return err
    return ApiError(err.status, err.message.replace(f"'{err.param}'", f"'{theirs}'"), theirs, err.code,
                    err.error_type, err.headers)

def response_id(completion: Completion) -> str:
    return "resp_" + completion.request_id.split("-", 1)[-1]


def response_object(completion: Completion, output: list[dict], status: str | None = None) -> dict:
    """The response object, as response.created (status in_progress, no output yet) and as the final answer."""
    request = completion.request
    reason = completion.finish_reason
    if status is None:
        status = "incomplete" if reason == "length" else "completed" if reason is not None else "failed"
    tools = request.tools
    return {
        "id": response_id(completion), "object": "response", "created_at": completion.created, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": _error_body(completion.error) if status == "failed" and completion.error is not None else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,  # not echoed: the request's system text holds the tool prompt too
        "max_output_tokens": request.sampling.max_tokens, "model": completion.model, "output": output,
        "parallel_tool_calls": tools.parallel if tools else True,
        "previous_response_id": request.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": request.sampling.temperature, "top_p": request.sampling.top_p,
        "text": {"format": _format_echo(request)}, "truncation": "disabled",
        "tool_choice": _choice_echo(tools), "tools": [{"type": "function", **t, "strict": False}
                                                      for t in (tools.tools if tools else ())],
        "metadata": {},
        "usage": _usage(completion) if status != "in_progress" else None,
    }


def _usage(completion: Completion) -> dict:
    return {"input_tokens": completion.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": completion.num_cached_tokens},
            "output_tokens": completion.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": completion.num_prompt_tokens + completion.num_output_tokens}


def _format_echo(request: GenerateRequest) -> dict:
    structured = request.sampling.structured
    if request.structured_param == "text.format" and structured is not None:
        kind, source = structured
        if kind == "json_schema":
            return {"type": "json_schema", "name": "output", "schema": json.loads(source), "strict": True}
        return {"type": kind}
    return {"type": "text"}


def _choice_echo(tools) -> str | dict:
    if tools is None:
        return "auto"
    return {"type": "function", "name": tools.named} if tools.choice == "named" else tools.choice


def _error_body(err) -> dict:
    return {"code": err.code or "server_error", "message": err.message}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str | None) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text is not None else []}


def _call_item(item_id: str, call: dict, status: str) -> dict:
    function = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"] if status == "completed" else "", "status": status}


class ResponsesStream(StreamWriter):
    """The Responses stream: response.created and response.in_progress, then per output item its added, deltas,
    done events, then response.completed (response.incomplete when cut by max_output_tokens, response.failed
    after an error event); every event with its sequence_number, in order from 0. Tool calls arrive as chat's
    fragments (the first with the call's id and name, then pieces of its arguments)."""

    def __init__(self, completion: Completion) -> None:
        self.completion = completion
        self.sequence = 0
        self.output: list[dict] = []  # finished items
        self.open_item: dict | None = None  # the reasoning, message or function_call item being streamed
        self.text = ""  # its text (a call's arguments) so far
        self.rid = response_id(completion)[5:]

    def _emit(self, kind: str, **data) -> bytes:
        event = sse_event(kind, {"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return event

    def open(self) -> bytes:
        initial = response_object(self.completion, [], "in_progress")
        return self._emit("response.created", response=initial) + self._emit("response.in_progress",
                                                                              response=initial)

    def event(self, delta: ChoiceDelta | None) -> bytes:
        if delta is None:
            return b""
        out = b""
        if delta.reasoning:
            out += self._text_delta("reasoning", delta.reasoning)
        if delta.content:
            out += self._text_delta("message", delta.content)
        for fragment in delta.calls:
            out += self._call_fragment(fragment)
        if delta.finish_reason is not None:
            out += self._close_item()
        return out

    def _open(self, item: dict) -> bytes:
        self.open_item, self.text = item, ""
        return self._emit("response.output_item.added", output_index=len(self.output), item=item)

    def _text_delta(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open_item is None or self.open_item["type"] != kind:
            out += self._close_item()
            item_id = f"{'rs' if kind == 'reasoning' else 'msg'}_{self.rid}_{len(self.output)}"
            out += self._open(_reasoning_item(item_id, None) if kind == "reasoning"
                              else _message_item(item_id, "", "in_progress"))
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
            out += self._emit("response.content_part.added", item_id=item_id, output_index=len(self.output),
                              content_index=0, part=part)
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + self._emit(name, item_id=self.open_item["id"], output_index=len(self.output), content_index=0,
                                delta=text, **extra)

    def _call_fragment(self, fragment: dict) -> bytes:
        out = b""
        if fragment.get("id") or self.open_item is None or self.open_item["type"] != "function_call":
            out += self._close_item()
            call = {"id": fragment.get("id") or f"call_{self.rid}_{len(self.output)}",
                    "function": {"name": fragment.get("function", {}).get("name", ""), "arguments": ""}}
            out += self._open(_call_item(f"fc_{self.rid}_{len(self.output)}", call, "in_progress"))
        piece = fragment.get("function", {}).get("arguments") or ""
        if piece:
            self.text += piece
            out += self._emit("response.function_call_arguments.delta", item_id=self.open_item["id"],
                              output_index=len(self.output), delta=piece)
        return out

    def _close_item(self) -> bytes:
        item = self.open_item
        if item is None:
            return b""
        index, kind, item_id = len(self.output), item["type"], item["id"]
        if kind == "function_call":
            done = {**item, "arguments": self.text, "status": "completed"}
            out = self._emit("response.function_call_arguments.done", item_id=item_id, output_index=index,
                             name=item["name"], arguments=self.text)
        else:
            if kind == "reasoning":
                part, done = {"type": "reasoning_text", "text": self.text}, _reasoning_item(item_id, self.text)
                out = self._emit("response.reasoning_text.done", item_id=item_id, output_index=index,
                                 content_index=0, text=self.text)
            else:
                part, done = _text_part(self.text), _message_item(item_id, self.text, "completed")
                out = self._emit("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                 text=self.text, logprobs=[])
            out += self._emit("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                              part=part)
        out += self._emit("response.output_item.done", output_index=index, item=done)
        self.output.append(done)
        self.open_item, self.text = None, ""
        return out

    def close(self) -> bytes:
        out = self._close_item()
        final = response_object(self.completion, self.output)
        name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._emit(name, response=final)

    def error(self, err: ApiError) -> bytes:
        out = self._emit("error", code=err.code, message=err.message, param=err.param)
        return out + self._emit("response.failed", response=response_object(self.completion, self.output, "failed"))
