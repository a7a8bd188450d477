"""Where this server used to differ from OpenAI, each on the request parsing or the response building: an
over-long prompt's error, a batch of prompts, the chat stream's first and last chunks, cached prompt tokens in
usage, chat logprobs without the end-of-turn token, a forced tool call cut by max_tokens, logprobs 0,
stream_options without a stream, and the default policy's tiers (never a silently dropped feature)."""

import dataclasses
import json

import pytest

from contracts.events import FinishReason, Logprob, TokenEvent, TopLogprob
from contracts.messages import PrefillFailed
from edge.api.chat_completions import ChatCompletionsApi
from edge.api.completion import Completion
from edge.api.completions import CompletionsApi, batch_prompts, check_batch
from edge.api.errors import prefill_error
from edge.api.openai_bodies import usage_chunk
from edge.api.openai_request import ApiError, parse_request
from edge.chat.tool_formats import ChatFormat
from edge.http.completion_batch import join
from policies.enforcer import PolicyEnforcer, PolicyRejection, RequestFacts
from policies.loader import load_policy

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "time", "parameters": WEATHER}}]


def chat(**fields):
    return parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, "chat",
                         chat=ChatFormat())


def completion(**fields):
    return parse_request({"model": "m", "prompt": "hi", **fields}, "completion")


def refused(body: dict, kind: str) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request({"model": "m", **body}, kind, chat=ChatFormat() if kind == "chat" else None)
    assert info.value.status == 400
    return info.value


def lp(token: str, logprob: float = -0.5) -> Logprob:
    return Logprob(1, logprob, token, (TopLogprob(1, logprob, token),))


def event(text: str, n: int, finish: FinishReason | None = None, logprobs=()) -> TokenEvent:
    return TokenEvent("chatcmpl-1", (n,), text, finish, logprobs=tuple(logprobs), num_prompt_tokens=9,
                      num_output_tokens=n)


def api_of(request):
    return ChatCompletionsApi() if request.kind == "chat" else CompletionsApi()


def answer(request, events) -> tuple[Completion, list[dict]]:
    """The events through the API's stream writer: the completion and its stream chunks."""
    built = Completion("chatcmpl-1", request, "m")
    writer, raw = api_of(request).writer(built), b""
    for e in events:
        built.add(e)
        raw += writer.event(built.delta(e))
    return built, [json.loads(block.removeprefix("data: ")) for block in raw.decode().split("\n\n") if block]


def body(built: Completion) -> dict:
    return api_of(built.request).body(built)


# --- the request ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, body", [("chat", {"messages": [{"role": "user", "content": "hi"}]}),
                                        ("completion", {"prompt": "hi"})])
def test_stream_options_without_stream_is_refused(kind, body):
    err = refused({**body, "stream_options": {"include_usage": True}}, kind)
    assert err.param == "stream_options" and "stream" in err.message
    err = refused({**body, "stream": False, "stream_options": {}}, kind)
    assert err.param == "stream_options"
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize("prompt", [["one", "two"], [[1, 2], [3, 4]], ["one", [1, 2]]])
def test_a_batch_of_prompts_is_refused_by_name(prompt):
    err = refused({"prompt": prompt}, "completion")
    assert (err.param, err.code) == ("prompt", "unsupported_parameter")
    assert f"batch of {len(prompt)} prompts" in err.message and "separate requests" in err.message


def test_a_batch_of_one_prompt_passes():
    assert completion(prompt=["one"]).prompt == "one"
    assert completion(prompt=[[5, 6]]).prompt_tokens == (5, 6)


def test_logprobs_zero_asks_for_the_sampled_tokens_logprob():
    request = completion(logprobs=0)
    assert request.sampling.logprobs == 0 and request.asked_logprobs
    built, _ = answer(request, [event(" a", 1, logprobs=[Logprob(7, -0.25, " a")]),
                                event(" b", 2, FinishReason.LENGTH, logprobs=[Logprob(8, -1.5, " b")])])
    logprobs = body(built)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" a", " b"] and logprobs["token_logprobs"] == [-0.25, -1.5]
    assert logprobs["top_logprobs"] == [{" a": -0.25}, {" b": -1.5}]  # the sampled token's, as vLLM


# --- an over-long prompt ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("param", ["messages", "prompt"])
def test_an_over_long_prompt_is_openais_400_naming_the_models_context(param):
    err = prefill_error(PrefillFailed("r", "prompt_too_long", "x", 3000, 2048), 8192, param)
    assert (err.status, err.code, err.param, err.error_type) == (400, "context_length_exceeded", param,
                                                                 "invalid_request_error")
    assert "maximum context length is 8192 tokens" in err.message
    assert "limited to 2048 tokens" in err.message and "3000 tokens" in err.message


def test_the_models_context_alone_when_it_is_the_limit():
    err = prefill_error(PrefillFailed("r", "prompt_too_long", "x", 1300, 1199), 1200, "prompt")
    assert "maximum context length is 1200 tokens" in err.message and "limited to" not in err.message


# --- the chat stream --------------------------------------------------------------------------------------------

def test_a_chat_stream_opens_with_the_role_alone_and_ends_with_finish_reason_alone():
    _, chunks = answer(chat(stream=True), [event("Hel", 1), event("lo", 2), event("!", 3, FinishReason.LENGTH)])
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"] == {"role": "assistant", "content": None} and choices[0]["finish_reason"] is None
    assert [c["delta"] for c in choices[1:-1]] == [{"content": "Hel"}, {"content": "lo"}, {"content": "!"}]
    assert all(c["finish_reason"] is None for c in choices[:-1])
    assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "length"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1


def test_a_chat_stream_whose_last_event_is_empty_ends_without_a_content_delta():
    _, chunks = answer(chat(stream=True), [event("Hi", 1), event("", 2, FinishReason.STOP)])
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": None},
                                                         {"content": "Hi"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_streams_keep_their_one_chunk_per_event():
    _, chunks = answer(completion(stream=True), [event("a", 1), event("b", 2, FinishReason.LENGTH)])
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("a", None),
                                                                                            ("b", "length")]


# --- usage ------------------------------------------------------------------------------------------------------

def test_usage_says_how_many_prompt_tokens_came_from_the_cache():
    built, _ = answer(chat(), [event("x", 1, FinishReason.LENGTH)])
    assert built.usage["prompt_tokens_details"] == {"cached_tokens": 0}
    built.cached_tokens = 6
    usage = body(built)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 6} and usage["prompt_tokens"] == 9
    assert usage_chunk(built, "chat.completion.chunk")["usage"]["prompt_tokens_details"] == {"cached_tokens": 6}


# --- chat logprobs ----------------------------------------------------------------------------------------------

def test_chat_logprobs_leave_out_the_end_of_turn_token():
    events = [event("Hel", 1, logprobs=[lp("Hel")]), event("lo", 2, logprobs=[lp("lo")]),
              event("", 3, FinishReason.STOP, logprobs=[lp("<|im_end|>")])]
    built, chunks = answer(chat(logprobs=True, top_logprobs=1, stream=True), events)
    choice = body(built)["choices"][0]
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    assert tokens == ["Hel", "lo"] and "".join(tokens) == choice["message"]["content"]
    streamed = [e["token"] for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed == ["Hel", "lo"]


def test_chat_logprobs_keep_the_last_token_of_an_answer_cut_by_length():
    built, _ = answer(chat(logprobs=True), [event("Hel", 1, logprobs=[lp("Hel")]),
                                            event("lo", 2, FinishReason.LENGTH, logprobs=[lp("lo")])])
    assert [e["token"] for e in body(built)["choices"][0]["logprobs"]["content"]] == ["Hel", "lo"]


# --- a forced tool call cut by max_tokens -----------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice, text, name, arguments", [
    ({"type": "function", "function": {"name": "get_weather"}},
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "get_weather", '{"city": "Par'),
    ({"type": "function", "function": {"name": "get_weather"}}, '<tool_call>\n{"name": "get_wea', "get_weather", ""),
    ("required", '<tool_call>\n{"name": "get_time", "arguments": {"ci', "get_time", '{"ci'),
])
def test_a_forced_tool_call_cut_by_max_tokens_is_a_call_with_finish_reason_length(tool_choice, text, name,
                                                                                   arguments):
    request = chat(tools=TOOLS, tool_choice=tool_choice)
    built, _ = answer(request, [event(text, 5, FinishReason.LENGTH)])
    choice = body(built)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"] and call["function"] == {"name": name, "arguments": arguments}


@pytest.mark.parametrize("text, name", [('<tool_call>\n{"na', ""), ('<tool_call>\n{"name": "get_', "get_")])
def test_required_cut_before_the_whole_name_is_a_call_never_markup_as_content(text, name):
    """Issue 48.7: two tools and the answer cut before the function's name was whole: a tool_calls entry with what
    was written (the name so far, no arguments), in the body and in the stream alike."""
    for stream in (False, True):
        built, chunks = answer(chat(tools=TOOLS, tool_choice="required", stream=stream),
                               [event(text[:4], 1), event(text[4:], 3, FinishReason.LENGTH)])
        choice = body(built)["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"] == {"name": name, "arguments": ""}
        if stream:
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            assert not any(d.get("content") for d in deltas)  # the template's markup never goes out as text
            calls = [call for d in deltas for call in d.get("tool_calls", [])]
            assert [call["function"]["name"] for call in calls] == [name] and calls[0]["id"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_finished_forced_call_still_ends_with_tool_calls():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    built, _ = answer(chat(tools=TOOLS, tool_choice="required"), [event(text, 9, FinishReason.STOP)])
    choice = body(built)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


# --- degradation: never a silently dropped feature --------------------------------------------------------------

def test_logprobs_a_tier_strips_are_marked_in_the_body():
    request = chat(logprobs=True)
    stripped = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, logprobs=None))
    built, _ = answer(stripped, [event("Hi", 1, FinishReason.LENGTH)])
    answered = body(built)
    assert answered["choices"][0]["logprobs"] is None and "logprobs" in answered["degraded"]
    assert "degraded" in usage_chunk(built, "chat.completion.chunk")
    plain, _ = answer(chat(), [event("Hi", 1, FinishReason.LENGTH)])
    assert "degraded" not in body(plain)


def _default_enforcer(signals: dict) -> PolicyEnforcer:
    enforcer = PolicyEnforcer(load_policy("policies/default.toml"))
    enforcer.update_signals({"kv_cache_usage": 0.0, "waiting_requests": 0.0, "prefill_queue": 0.0,
                             "cpu_percent": 0.0, "memory_percent": 0.0, **signals})
    return enforcer


def test_the_default_policy_stays_normal_on_a_box_that_is_merely_working():
    enforcer = _default_enforcer({"cpu_percent": 100.0, "kv_cache_usage": 0.6, "waiting_requests": 8.0})
    decision = enforcer.decide(RequestFacts(None, None, "m", "hi", 10, 5, 1), {"m"})
    assert decision.tier == "normal" and decision.logprobs == 5 and not decision.notes


def test_the_default_busy_tier_refuses_logprobs_naming_the_tier():
    enforcer = _default_enforcer({"waiting_requests": 40.0})
    with pytest.raises(PolicyRejection) as info:
        enforcer.decide(RequestFacts(None, None, "m", "hi", 10, 0, 1), {"m"})
    assert (info.value.status, info.value.code) == (503, "logprobs_unavailable") and "'busy'" in info.value.message
    assert info.value.retry_after_s
    assert enforcer.decide(RequestFacts(None, None, "m", "hi", 10, None, 1), {"m"}).tier == "busy"


def test_a_streamed_forced_call_cut_by_max_tokens_sends_what_was_written_and_ends_with_length():
    request = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    _, chunks = answer(request, [event(text[:12], 1), event(text[12:], 2, FinishReason.LENGTH)])
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(call["function"]["arguments"] for call in calls) == '{"city": "Par'
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"


# --- a batch of prompts on /v1/completions ----------------------------------------------------------------------

def test_a_batch_is_two_or_more_prompts():
    assert batch_prompts({"prompt": ["a", "b"]}) == ["a", "b"]
    assert batch_prompts({"prompt": [[1, 2], "b"]}) == [[1, 2], "b"]
    assert batch_prompts({"prompt": ["a"]}) is None and batch_prompts({"prompt": [1, 2]}) is None
    assert batch_prompts({"prompt": "a"}) is None and batch_prompts([1]) is None


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": ["a", ""]}, "prompt[1]", "must not be empty"),
    ({"prompt": ["a", [5, 99]]}, "prompt[1][1]", "not a token id"),
    ({"prompt": ["a", ""], "stream": True}, "prompt[1]", "must not be empty"),  # streamed, checked the same
    ({"prompt": ["a"] * 5}, "prompt", "at most 4"),
    ({"prompt": ["a", "b"], "temperature": 9}, "temperature", "temperature"),
])
def test_every_prompt_of_a_batch_is_checked_before_any_is_queued(body, param, words):
    with pytest.raises(ApiError) as info:
        check_batch({"model": "m", **body}, body["prompt"], 50, 4)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


def test_a_batch_answer_is_prompt_major_with_summed_usage():
    def answer_of(prompt: int) -> dict:
        return {"id": f"cmpl-{prompt}", "object": "text_completion", "model": "m",
                "choices": [{"index": j, "text": f"p{prompt}c{j}", "finish_reason": "length"} for j in (1, 0)],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": prompt}}}
    joined = join({"n": 2}, [answer_of(0), answer_of(1), answer_of(2)])
    assert [(c["index"], c["text"]) for c in joined["choices"]] == [
        (0, "p0c0"), (1, "p0c1"), (2, "p1c0"), (3, "p1c1"), (4, "p2c0"), (5, "p2c1")]
    assert joined["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                               "prompt_tokens_details": {"cached_tokens": 3}}
    assert joined["id"] == "cmpl-0"
