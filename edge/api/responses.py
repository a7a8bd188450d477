"""POST /v1/responses (OpenAI Responses), stateless: the body becomes a chat completions request, and the answer
(edge.api.completion) becomes a response object and the Responses stream's semantic events.

Nothing is stored: `store: true`, `previous_response_id` and the other stored-state fields are refused with a
400 that says so, and the client sends the whole conversation as `input` items each time."""

from __future__ import annotations

import json
import time

from edge.api.client_api import ClientApi, StreamWriter, sse_event
from edge.api.completion import ChoiceDelta, Completion
from edge.api.fields import get_field, nested_string, show
from edge.api.openai_request import ApiError, GenerateRequest, parse_request

ROLES = {"user", "system", "developer", "assistant"}
TEXT_PARTS = {"input_text", "output_text", "text"}
# fields of stored state or hosted features this stateless server cannot honour: (field, value it may have)
REFUSED = {"previous_response_id": None, "conversation": None, "background": False, "prompt": None,
           "truncation": "disabled"}
# our chat extensions a Responses client may send as extra body fields, passed through unchanged
PASSED = ("priority", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "stop", "cache_salt", "parallel_tool_calls", "stream")
PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


class ResponsesApi(ClientApi):
    route = "/v1/responses"

    def parse(self, body, vocab_size: int | None, chat=None) -> GenerateRequest:
        translated = chat_body(body)
        try:
            return parse_request(translated, "chat", vocab_size=vocab_size, chat=chat)
        except ApiError as err:  # name the Responses field, not the chat field it became
            raise _renamed(err) from None

    def error(self, err: ApiError):
        return _renamed(err).response()  # failures after parsing too (an over-long prompt names the input)

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


def chat_body(body) -> dict:
    """The chat completions body a Responses body asks for; refusals name the Responses field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("store"):
        raise ApiError(400, "store: true is not supported: this server keeps no responses (send store: false, or "
                            "leave it out, and send the whole conversation as input)", "store", "unsupported_parameter")
    for name, neutral in REFUSED.items():
        if body.get(name, neutral) not in (neutral, None):
            why = ("this server keeps no responses or conversations; send the earlier turns as input items"
                   if name in ("previous_response_id", "conversation") else "it is not supported by this server")
            raise ApiError(400, f"{name}={show(body[name])}: {why}", name, "unsupported_parameter")
    if body.get("top_logprobs"):
        raise ApiError(400, "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                       "top_logprobs", "unsupported_parameter")
    chat = {"model": body.get("model"), "messages": _messages(body)}
    chat.update({name: body[name] for name in PASSED if name in body})
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if (tools := _tools(body)) is not None:
        chat["tools"] = tools
    if (choice := _tool_choice(body.get("tool_choice"))) is not None:
        chat["tool_choice"] = choice
    if (fmt := _text_format(body)) is not None:
        chat["response_format"] = fmt
    return chat


def _messages(body: dict) -> list[dict]:
    instructions = get_field(body, "instructions", str, default=None)
    messages = [{"role": "system", "content": instructions}] if instructions else []
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of input items", "input",
                       "missing_required_parameter" if items is None else "invalid_type")
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ApiError(400, f"{param}.role must be one of {sorted(ROLES)}", f"{param}.role", "invalid_value")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"type": "function", "id": item.get("call_id") or "",
                    "function": {"name": nested_string(item, "name", param),
                                 "arguments": nested_string(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # consecutive calls are one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                             "content": output if isinstance(output, str) else _text(output, f"{param}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: templates leave it out of the prompt, and so does this server
        else:
            raise ApiError(400, f"{param}.type {show(kind)} is not supported here (message, function_call, "
                                f"function_call_output or reasoning)", f"{param}.type", "unsupported_parameter")
    return messages


def _text(content, param: str):
    """A message's content: a string or text parts (input_text, output_text); other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{param} must be a string or a list of input_text parts", param, "invalid_type")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{param}[{j}]: only text parts ({{\"type\": \"input_text\", \"text\": ...}}) are "
                                f"supported, got type {show(kind)} (this server serves a text-only model)",
                           f"{param}[{j}]", "unsupported_parameter")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"tools[{i}]: only function tools are supported, not {show(kind)} (hosted tools "
                                f"need services this server does not run)", f"tools[{i}]", "unsupported_parameter")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                   "tool_choice", "invalid_value")


def _text_format(body: dict) -> dict | None:
    text = get_field(body, "text", dict, default=None)
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format.schema must be a JSON schema object", "text.format", "invalid_value")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, not {show(kind)}",
                   "text.format", "invalid_value")


def _renamed(err: ApiError) -> ApiError:
    param = err.param or ""
    for ours, theirs in PARAMS.items():
        if param == ours or param.startswith(ours + "["):
            message = err.message.replace(f"'{ours}'", f"'{theirs}'").replace(ours, theirs, 1)
            return ApiError(err.status, message, theirs + param[len(ours):], err.code, err.error_type, err.headers)
    return err


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
        "parallel_tool_calls": tools.parallel if tools else True, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": False,
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
    if request.structured_param == "response_format" and structured is not None:
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
