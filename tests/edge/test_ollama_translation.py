"""Ollama's /api/chat and /api/generate as a translation, without a server: bodies into the internal request (options
under their Ollama names, format, think, tools, messages), the answer into Ollama's objects and NDJSON stream (the
durations in nanoseconds from the request's timestamps), errors into {"error": "..."} (edge/api/ollama*.py)."""

import json
from types import SimpleNamespace

import pytest

from contracts.events import FinishReason, Logprob, TokenEvent, TopLogprob
from edge.api.completion import Completion
from edge.api.ollama import NS, OllamaChatApi, OllamaGenerateApi, durations, error_line, error_response
from edge.api.ollama_models import display_name, human_count, quantization
from edge.api.openai_request import ApiError
from edge.chat.tool_formats import ChatFormat
from edge.core.lifecycle import InFlight, InFlightRegistry

GATEWAY = SimpleNamespace(registry=InFlightRegistry())
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
THINKING = ChatFormat(reasoning="think")


def served(name: str):
    return "m" if name in ("m", "m:latest") else None


def chat(chat_format=None, **body):
    api = OllamaChatApi(served, GATEWAY.registry.get)
    return api, api.parse({"model": "m", "messages": HI, **body}, 49152, chat_format or ChatFormat())


def generate(chat_format=None, **body):
    api = OllamaGenerateApi(served, GATEWAY.registry.get)
    return api, api.parse({"model": "m", "prompt": "Hi", **body}, 49152, chat_format or ChatFormat())


def token(text: str, n: int, finish: FinishReason | None = None, logprobs=()) -> TokenEvent:
    return TokenEvent("chatcmpl-1", (n,), text, finish, logprobs=logprobs, num_prompt_tokens=9, num_output_tokens=n)


def streamed(api, request, texts: list[str], finish=FinishReason.STOP) -> list[dict]:
    completion = Completion("chatcmpl-1", request, "m")
    writer, raw = api.writer(completion), b""
    for i, text in enumerate(texts):
        event = token(text, i + 1, finish if i == len(texts) - 1 else None)
        completion.add(event)
        raw += writer.event(completion.delta(event))
    raw += writer.close()
    assert raw.endswith(b"\n") and b"\n\n" not in raw  # NDJSON: one object per line
    return [json.loads(line) for line in raw.decode().splitlines()]


def answered(api, request, texts: list[str], finish=FinishReason.STOP) -> dict:
    completion = Completion("chatcmpl-1", request, "m")
    for i, text in enumerate(texts):
        completion.add(token(text, i + 1, finish if i == len(texts) - 1 else None))
    return api.body(completion)


def test_options_map_onto_our_sampling_under_ollamas_names():
    _, request = chat(options={"temperature": 0.2, "top_p": 0.9, "top_k": 40, "seed": 42, "num_predict": 64,
                               "stop": ["\n", "user:"], "repeat_penalty": 1.1, "presence_penalty": 0.5,
                               "frequency_penalty": 0.25, "min_p": 0.05})
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens) == (0.2, 0.9, 40, 42, 64)
    assert s.stop == ("\n", "user:") and s.repetition_penalty == 1.1
    assert (s.presence_penalty, s.frequency_penalty, s.min_p) == (0.5, 0.25, 0.05)
    assert request.stream  # Ollama streams unless told not to


def test_ollamas_special_values_and_ignored_options():
    _, request = chat(options={"num_predict": -1, "seed": -1, "num_ctx": 8192, "num_gpu": 99, "num_thread": 8,
                               "repeat_last_n": 64, "mirostat": 0, "typical_p": 1.0, "made_up": "x"}, stream=False)
    assert request.sampling.max_tokens is None and request.sampling.seed is None  # the policy's limit, random
    assert not request.stream
    _, request = chat(options={"num_predict": -2})
    assert request.sampling.max_tokens is None


@pytest.mark.parametrize(("body", "param"), [
    ({"options": {"temperature": 9}}, "options.temperature"),
    ({"options": {"temperature": "hot"}}, "options.temperature"),
    ({"options": {"num_predict": 0}}, "options.num_predict"),
    ({"options": {"top_p": 0}}, "options.top_p"),
    ({"options": {"stop": [""]}}, "options.stop"),
    ({"options": {"mirostat": 2}}, "options.mirostat"),
    ({"options": {"typical_p": 0.7}}, "options.typical_p"),
    ({"options": "hot"}, "options"),
    ({"format": "xml"}, "format"),
    ({"think": "very"}, "think"),
    ({"think": True}, "think"),  # the model has no thinking
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages[0].images"),
    ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages[0].tool_calls[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
])
def test_chat_refusals_name_the_ollama_field(body, param):
    with pytest.raises(ApiError) as refused:
        chat(**body)
    assert refused.value.status == 400 and refused.value.param == param


@pytest.mark.parametrize(("body", "param"), [
    ({"suffix": "return x"}, "suffix"), ({"template": "{{ .Prompt }}"}, "template"), ({"context": [1, 2]}, "context"),
    ({"images": ["aGk="]}, "images"), ({"raw": True, "system": "x"}, "system"), ({"prompt": 5}, "prompt")])
def test_generate_refusals(body, param):
    with pytest.raises(ApiError) as refused:
        generate(**body)
    assert refused.value.status == 400 and refused.value.param == param


def test_model_names():
    api, request = chat(model="m:latest")
    assert request.model == "m" and api.parsed.sent_model == "m:latest"
    api, request = chat(model="other")
    assert request.model == "other"  # not served: the gateway's model check answers 404
    assert display_name("m") == "m:latest" and display_name("m:q8") == "m:q8" and display_name("a/b") == "a/b:latest"


def test_format_json_and_schema():
    _, request = chat(format="json")
    assert request.sampling.structured == ("json_object", "") and request.structured_param == "format"
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    _, request = generate(format=schema)
    assert request.sampling.structured == ("json_schema", json.dumps(schema))
    _, request = generate(format="json", raw=True)
    assert request.kind == "completion" and request.sampling.structured == ("json_object", "")


def test_generate_is_a_chat_of_system_and_prompt_or_raw():
    _, request = generate(system="Be brief.")
    assert request.kind == "chat" and [(m["role"], m["content"]) for m in request.messages] == [
        ("system", "Be brief."), ("user", "Hi")]
    _, request = generate(raw=True, prompt="<|im_start|>user\nHi")
    assert request.kind == "completion" and request.prompt == "<|im_start|>user\nHi" and request.messages is None


def test_history_with_tool_calls_and_results():
    _, request = chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "thinking": "hm",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain", "tool_name": "get_weather"}])
    assert [m["role"] for m in request.messages] == ["system", "user", "assistant", "tool"]
    assert "Oslo" in request.messages[2]["content"] and "hm" not in request.messages[2]["content"]
    assert request.tools.choice == "auto" and request.tools.names == {"get_weather"}


def test_chat_stream_is_ollamas_ndjson():
    api, request = chat(model="m:latest")
    lines = streamed(api, request, ["Hel", "lo", "!"])
    assert [line["message"]["content"] for line in lines] == ["Hel", "lo", "!", ""]
    assert [line["done"] for line in lines] == [False, False, False, True]
    assert all(line["model"] == "m:latest" and line["created_at"].endswith("Z") for line in lines)
    assert all(set(line) == {"model", "created_at", "message", "done"} for line in lines[:-1])
    final = lines[-1]
    assert final["done_reason"] == "stop" and (final["prompt_eval_count"], final["eval_count"]) == (9, 3)
    assert all(isinstance(final[k], int) for k in ("total_duration", "load_duration", "prompt_eval_duration",
                                                   "eval_duration"))


def test_generate_stream_and_body():
    api, request = generate()
    lines = streamed(api, request, ["Blue", ""], FinishReason.LENGTH)
    assert [line.get("response") for line in lines] == ["Blue", ""] and lines[-1]["done_reason"] == "length"
    body = answered(api, request, ["Blue", "!"], FinishReason.LENGTH)
    assert body["response"] == "Blue!" and body["done"] is True and body["done_reason"] == "length"
    assert body["eval_count"] == 2 and "message" not in body


def test_tool_calls_answer_whole_with_arguments_as_objects():
    api, request = chat(tools=[WEATHER], stream=False)
    body = answered(api, request, [CALL[:20], CALL[20:]])
    assert body["message"]["content"] == "" and body["done_reason"] == "stop"
    assert [c["function"] for c in body["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    lines = streamed(api, request, [CALL[:20], CALL[20:40], CALL[40:]])
    calls = [line["message"]["tool_calls"] for line in lines if "tool_calls" in line["message"]]
    assert calls == [[{"id": calls[0][0]["id"], "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]]
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"
    assert not any(line["message"]["content"] for line in lines)  # the call's markup is never content


def test_thinking_is_returned_beside_the_answer_unless_think_is_false():
    api, request = chat(THINKING, think=True)
    body = answered(api, request, ["<think>sky", " is blue</think>", "Blue."])
    assert body["message"]["thinking"] == "sky is blue" and body["message"]["content"] == "Blue."
    lines = streamed(api, request, ["<think>sky", " is blue</think>", "Blue."])
    assert "".join(line["message"].get("thinking", "") for line in lines) == "sky is blue"
    assert "".join(line["message"]["content"] for line in lines) == "Blue."
    api, request = chat(THINKING, think=False)
    body = answered(api, request, ["<think>sky</think>", "Blue."])
    assert "thinking" not in body["message"] and body["message"]["content"] == "Blue."
    assert all("thinking" not in line["message"] for line in streamed(api, request, ["<think>sky</think>", "Blue."]))


def test_logprobs_in_chunks_and_body():
    api, request = chat(logprobs=True, top_logprobs=1)
    entry = Logprob(5, -0.5, "Hi", (TopLogprob(5, -0.5, "Hi"),))
    completion = Completion("chatcmpl-1", request, "m")
    completion.add(token("Hi", 1, FinishReason.STOP, (entry,)))
    expected = [{"token": "Hi", "logprob": -0.5, "top_logprobs": [{"token": "Hi", "logprob": -0.5}]}]
    assert api.body(completion)["logprobs"] == expected
    end = Logprob(2, -0.1, "<|im_end|>")
    completion = Completion("chatcmpl-1", request, "m")
    completion.add(token("Hi", 1, None, (entry,)))
    completion.add(token("", 2, FinishReason.STOP, (end,)))
    assert api.body(completion)["logprobs"] == expected  # the end-of-turn token is not in the text: left out
    completion = Completion("chatcmpl-1", request, "m")
    writer, raw = api.writer(completion), b""
    for event in (token("Hi", 1, None, (entry,)), token("", 2, FinishReason.STOP, (end,))):
        completion.add(event)
        raw += writer.event(completion.delta(event))
    lines = [json.loads(line) for line in (raw + writer.close()).decode().splitlines()]
    assert [line.get("logprobs") for line in lines] == [expected, None] and lines[-1]["done"]
    api, request = chat()
    completion = Completion("chatcmpl-1", request, "m")
    completion.add(token("Hi", 1, FinishReason.STOP, (entry,)))
    assert "logprobs" not in api.body(completion)  # only when asked


def test_durations_in_nanoseconds_from_the_requests_timestamps():
    _, request = chat()
    completion = Completion("chatcmpl-1", request, "m")
    completion.add(token("Hi", 4, FinishReason.STOP))
    inflight = InFlight("chatcmpl-1", 0, created=10.25, prefill_started_at=10.5, handed_off_at=11.0,
                        first_token_at=11.0)
    out = durations(completion, inflight, started=10.0, now=13.0)
    assert out == {"total_duration": 3 * NS, "load_duration": NS // 4, "prompt_eval_count": 9,
                   "prompt_eval_duration": NS // 2, "eval_count": 4, "eval_duration": 2 * NS}
    assert durations(completion, None, started=10.0, now=10.5)["total_duration"] == NS // 2
    # a request that waited 2 s for its model: the gateway moved created back by the wait (it counts in TTFT);
    # Ollama's load_duration holds the wait
    loaded = InFlight("chatcmpl-2", 0, created=10.25, load_wait_s=2.0, prefill_started_at=12.5, handed_off_at=13.0)
    assert durations(completion, loaded, started=8.0, now=15.0)["load_duration"] == 4.25 * NS


def test_final_object_reads_the_gateways_registry():
    api, request = chat()
    inflight = InFlight("chatcmpl-1", 0, prefill_started_at=api.started - 0.002, handed_off_at=api.started - 0.001)
    GATEWAY.registry.add(inflight)
    try:
        body = answered(api, request, ["Hi"])
    finally:
        GATEWAY.registry.remove("chatcmpl-1")
    assert body["prompt_eval_duration"] == 1_000_000 and body["eval_duration"] > 0


def test_errors_in_ollamas_shape():
    response = error_response(ApiError(429, "slow down", headers={"Retry-After": "2"}))
    assert response.status == 429 and response.headers["Retry-After"] == "2"
    assert json.loads(response.body) == {"error": "slow down"}
    assert api_error_line() == {"error": "engine gone"}


def api_error_line() -> dict:
    raw = error_line(ApiError(503, "engine gone"))
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    return json.loads(raw)


def test_model_details_names():
    assert (quantization(3), quantization(15), quantization(1), quantization(0)) == ("Q4_1", "Q4_K_M", "F16", "F32")
    assert (human_count(134_515_008), human_count(8_030_261_248), human_count(999)) == ("134.52M", "8.0B", "999")
