"""The gateway's tokenizer for /tokenize and /detokenize: the GGUF's vocabulary alone, rendered as a worker does."""

import pytest

from edge.api.fields import ApiError
from edge.http.tokenize import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(embedded_model_path):
    return Tokenizer(embedded_model_path)


def test_text_round_trips_and_chat_adds_the_templates_markers(tokenizer):
    text = "Hello, world: tokens and back again."
    tokens = tokenizer.completion(text, add_special=False)
    assert tokens and tokenizer.detokenize(tokens) == text
    assert tokenizer.completion(text, add_special=True) == tokens  # this GGUF asks for no BOS
    chat = tokenizer.chat([{"role": "user", "content": text}])
    assert len(chat) > len(tokens) and "<|im_start|>user" in tokenizer.detokenize(chat)


def test_an_id_outside_the_vocabulary_is_named(tokenizer):
    with pytest.raises(ApiError) as caught:
        tokenizer.detokenize([1, 10**9])
    assert caught.value.param == "tokens[1]"
