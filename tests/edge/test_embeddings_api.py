"""The embeddings body parsed and answered, and a completion's prompt logprobs in OpenAI's and vLLM's shapes."""

import base64

import numpy as np
import pytest

from contracts.events import Logprob, TopLogprob
from contracts.messages import EmbedDone, PromptLogprobs
from edge.api.openai_request import ApiError
from edge.api.prompt_scores import echo_text, vllm_prompt_logprobs, with_prompt
from edge.http.embeddings import MAX_INPUTS, _body, parse_embeddings


def _parsed(**fields):
    return parse_embeddings({"model": "m", **fields}, vocab_size=100)


def test_every_input_shape_is_taken():
    assert _parsed(input="hi").request.embed_texts == ("hi",)
    assert _parsed(input=["a", "b"]).request.embed_texts == ("a", "b")
    assert _parsed(input=[1, 2, 3]).request.embed_tokens == ((1, 2, 3),)
    assert _parsed(input=[[1, 2], [3]]).request.embed_tokens == ((1, 2), (3,))
    parsed = _parsed(input="hi", encoding_format="base64", dimensions=576, priority=3)
    assert (parsed.encoding_format, parsed.dimensions, parsed.request.priority) == ("base64", 576, 3)
    assert parsed.request.kind == "embedding" and parsed.request.sampling.max_tokens == 0
    assert parsed.request.user_text == "hi"  # what the content filters read


@pytest.mark.parametrize("fields, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [""]}, "input[0]"),
    ({"input": ["a", [1]]}, "input"),
    ({"input": [[1], [100]]}, "input[1][0]"),
    ({"input": [[]]}, "input[0]"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "\ud800"}, "input[0]"),
])
def test_bad_bodies_name_their_field(fields, param):
    with pytest.raises(ApiError) as caught:
        _parsed(**fields)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_base64_carries_the_same_floats():
    vectors = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)  # [inputs, dim]
    done = EmbedDone("embd-1", 8, vectors.tobytes(), (3, 4))
    usage = {"prompt_tokens": 7, "total_tokens": 7}
    floats = _body(done, "float", "m", usage)
    encoded = _body(done, "base64", "m", usage)
    assert [d["index"] for d in floats["data"]] == [0, 1] and floats["usage"] == usage
    for plain, packed in zip(floats["data"], encoded["data"]):
        decoded = np.frombuffer(base64.b64decode(packed["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(plain["embedding"], dtype=np.float32))


SCORES = PromptLogprobs("cmpl-1", (7, 8, 9), ("Hello", " big", " world"), (
    Logprob(8, -2.0, " big", (TopLogprob(5, -0.5, " the"), TopLogprob(8, -2.0, " big"))),
    Logprob(9, -0.25, " world", (TopLogprob(9, -0.25, " world"), TopLogprob(6, -3.0, "!")))), (2, 1))


def test_echo_puts_the_prompt_first_with_a_null():
    generated = {"tokens": ["!"], "token_logprobs": [-1.0], "top_logprobs": [{"!": -1.0}], "text_offset": [0]}
    merged = with_prompt(SCORES, 1, generated)
    assert merged["tokens"] == ["Hello", " big", " world", "!"]
    assert merged["token_logprobs"] == [None, -2.0, -0.25, -1.0]
    # the prompt's own token beside the top k (" big" is not the likeliest), as vLLM answers
    assert merged["top_logprobs"] == [None, {" the": -0.5, " big": -2.0}, {" world": -0.25}, {"!": -1.0}]
    alone = with_prompt(SCORES, 0, generated)["top_logprobs"]  # logprobs 0: the token alone
    assert alone[:3] == [None, {" big": -2.0}, {" world": -0.25}]
    assert merged["text_offset"] == [0, 5, 9, 15]
    assert echo_text(None, SCORES) == "Hello big world" and echo_text("as sent", SCORES) == "as sent"


def test_vllm_prompt_logprobs_hold_the_token_and_the_top_k():
    out = vllm_prompt_logprobs(SCORES, 1)
    assert out[0] is None
    assert out[1] == {"5": {"logprob": -0.5, "rank": 1, "decoded_token": " the"},
                      "8": {"logprob": -2.0, "rank": 2, "decoded_token": " big"}}
    assert out[2] == {"9": {"logprob": -0.25, "rank": 1, "decoded_token": " world"}}
