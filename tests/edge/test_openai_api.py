"""parse_request: every value that reaches the prefill worker's msgpack wire is checked at the gateway."""

import dataclasses

import pytest

from contracts.handoff import SamplingParams
from edge.api.openai_request import MAX_MESSAGES, MAX_STOP_TOKEN_IDS, ApiError, parse_request
from edge.api.sampling_request import SamplingRequest

VOCAB = 49152  # SmolLM2's vocabulary size


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def _completion(**fields) -> dict:
    return {"model": "m", "prompt": "hi", **fields}


def _refused(body: dict, kind: str, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(body, kind, **kwargs)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body, kind, param", [
    (_chat(messages=[{"role": "user", "content": "a\ud800b"}]), "chat", "messages[0].content"),
    (_chat(messages=[{"role": "system", "content": "ok"}, {"role": "user", "content": [
        {"type": "text", "text": "fine"}, {"type": "text", "text": "\udfff"}]}]), "chat", "messages[1].content[1].text"),
    (_completion(prompt="\ud800"), "completion", "prompt"),
    (_completion(prompt=["x\udc00"]), "completion", "prompt[0]"),
    (_completion(stop="\ud800"), "completion", "stop"),
    (_chat(stop=["ok", "\ud83d"]), "chat", "stop[1]"),
    (_chat(model="m\ud800"), "chat", "model"),
])
def test_lone_surrogate_is_refused_naming_the_field(body, kind, param):
    err = _refused(body, kind)
    assert (err.param, err.code) == (param, "invalid_value")
    assert "lone surrogate" in err.message and param in err.message


def test_text_outside_the_bmp_and_text_parts_pass():
    parts = [{"type": "text", "text": "h\u00e9llo "}, {"type": "text", "text": "\U0001f642"}]
    request = parse_request(_chat(messages=[{"role": "user", "content": parts}], stop=["\u00e9"]), "chat")
    assert request.messages == ({"role": "user", "content": "h\u00e9llo \U0001f642"},)
    assert request.sampling.stop == ("\u00e9",)


@pytest.mark.parametrize("prompt, vocab_size, index", [
    ([1, VOCAB], VOCAB, 1),
    ([2**40], None, 0),
    ([5, -1], None, 1),
    ([5, -1], VOCAB, 1),
])
def test_prompt_token_id_out_of_range_is_refused(prompt, vocab_size, index):
    err = _refused(_completion(prompt=prompt), "completion", vocab_size=vocab_size)
    assert (err.param, err.code) == (f"prompt[{index}]", "invalid_value")
    assert f"prompt[{index}] is {prompt[index]}" in err.message


def test_vocabulary_size_is_named_and_the_last_id_passes():
    err = _refused(_completion(prompt=[VOCAB]), "completion", vocab_size=VOCAB)
    assert f"vocabulary has {VOCAB} tokens" in err.message and str(VOCAB - 1) in err.message
    request = parse_request(_completion(prompt=[0, VOCAB - 1], stop_token_ids=[VOCAB - 1]), "completion",
                            vocab_size=VOCAB)
    assert request.prompt_tokens == (0, VOCAB - 1) and request.sampling.stop_token_ids == (VOCAB - 1,)


@pytest.mark.parametrize("ids, vocab_size, param", [
    ([2, VOCAB], VOCAB, "stop_token_ids[1]"),
    ([-3], VOCAB, "stop_token_ids[0]"),
    ([2**40], None, "stop_token_ids[0]"),
    ([1] * (MAX_STOP_TOKEN_IDS + 1), None, "stop_token_ids"),
])
def test_stop_token_ids_out_of_range_are_refused(ids, vocab_size, param):
    err = _refused(_chat(stop_token_ids=ids), "chat", vocab_size=vocab_size)
    assert (err.param, err.code) == (param, "invalid_value")


@pytest.mark.parametrize("body, kind, param", [
    (_completion(max_tokens=2**40), "completion", "max_tokens"),
    (_chat(max_completion_tokens=2**40), "chat", "max_completion_tokens"),
    (_chat(messages=[{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)), "chat", "messages"),
    (_chat(temperature=10**400), "chat", "temperature"),  # float() of it overflows
])
def test_values_beyond_their_bounds_are_refused(body, kind, param):
    err = _refused(body, kind)
    assert (err.param, err.code) == (param, "invalid_value")


@pytest.mark.parametrize("body, param, code", [
    (_chat(temperature="hot"), "temperature", "invalid_type"),  # a (int, float) type in the message
    (_chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0]", "invalid_value"),  # unhashable role
])
def test_odd_types_get_400_not_a_crash(body, param, code):
    err = _refused(body, "chat")
    assert (err.param, err.code) == (param, code)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def test_deeply_nested_values_are_refused_without_recursing():
    err = _refused(_chat(best_of=_nested(100_000)), "chat")
    assert (err.param, err.code) == ("best_of", "unsupported_parameter")
    err = _refused(_chat(n=_nested(100_000)), "chat")
    assert (err.param, err.code) == ("n", "invalid_type")
    err = _refused(_chat(messages=[{"role": "user", "content": _nested(100_000)}]), "chat")
    assert err.param == "messages[0].content"


def test_output_controls_are_parsed_into_sampling_params():
    request = parse_request(_chat(logit_bias={"15": -100, "42": 2.5}, presence_penalty=0.5, frequency_penalty=-1,
                                  repetition_penalty=1.2, min_p=0.05, min_tokens=3, ignore_eos=True, logprobs=True,
                                  top_logprobs=2), "chat", vocab_size=VOCAB)
    params = request.sampling.decided(16, None).params()
    assert params.logit_bias == ((15, -100.0), (42, 2.5)) and (params.max_tokens, params.logprobs) == (16, None)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.0, 1.2)
    assert (params.min_p, params.min_tokens, params.ignore_eos) == (0.05, 3, True)
    neutral = parse_request(_completion(), "completion").sampling
    assert (neutral.logit_bias, neutral.repetition_penalty, neutral.min_tokens) == ((), 1.0, 0)


def test_the_sampling_request_is_typed_frozen_and_has_every_field_the_worker_samples_with():
    sampling = parse_request(_chat(temperature=0.5, n=2), "chat").sampling
    assert isinstance(sampling, SamplingRequest) and (sampling.temperature, sampling.n, sampling.max_tokens) == (
        0.5, 2, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sampling.n = 3
    assert [f.name for f in dataclasses.fields(SamplingRequest)] == [f.name for f in dataclasses.fields(SamplingParams)]
    with pytest.raises(ValueError):
        sampling.params()  # the policy decides max_tokens first
    params = sampling.decided(4, 3).params()  # the policy's decision applied, as the gateway does
    assert isinstance(params, SamplingParams) and (params.n, params.temperature, params.max_tokens,
                                                   params.logprobs) == (2, 0.5, 4, 3)


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # dividing a logit by it overflows
    ({"cache_salt": 5}, "cache_salt"),
    ({"cache_salt": "x" * 257}, "cache_salt"),
    ({"cache_salt": "\ud800"}, "cache_salt"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logit_bias": {"abc": 1}}, "logit_bias['abc']"),
    ({"logit_bias": {str(VOCAB): 1}}, f"logit_bias['{VOCAB}']"),
    ({"logit_bias": {"5": 101}}, "logit_bias['5']"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
])
def test_bad_output_controls_are_refused_naming_the_field(fields, param):
    err = _refused(_chat(**fields), "chat", vocab_size=VOCAB)
    assert err.param == param, err.message


def test_a_cache_salt_is_kept_for_the_gateway():
    assert parse_request(_chat(cache_salt="team-secret"), "chat").cache_salt == "team-secret"
    assert parse_request(_chat(), "chat").cache_salt == ""


def test_echo_takes_a_text_prompt_or_logprobs():
    assert parse_request(_completion(echo=True), "completion").echo
    assert not parse_request(_completion(), "completion").echo
    for body, kind in ((_chat(echo=True), "chat"), (_completion(prompt=[1, 2], echo=True), "completion")):
        err = _refused(body, kind)
        assert (err.param, err.code) == ("echo", "unsupported_parameter"), err.message


def test_echo_with_logprobs_scores_the_prompt():
    scored = parse_request(_completion(prompt=[[1, 2, 3]], echo=True, logprobs=2, max_tokens=0), "completion")
    assert (scored.prompt_tokens, scored.prompt_logprobs, scored.sampling.max_tokens) == ((1, 2, 3), 2, 0)
    assert parse_request(_completion(prompt_logprobs=5), "completion").prompt_logprobs == 5
    assert parse_request(_completion(logprobs=1), "completion").prompt_logprobs is None  # not echoed: not scored
    for body, kind, param in ((_chat(prompt_logprobs=1), "chat", "prompt_logprobs"),
                              (_completion(prompt_logprobs=21), "completion", "prompt_logprobs"),
                              (_completion(max_tokens=0, n=2), "completion", "n"),
                              (_chat(max_tokens=0), "chat", "max_tokens")):
        assert _refused(body, kind).param == param
