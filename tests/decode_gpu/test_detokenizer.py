"""Incremental detokenization: the streamed pieces add up to the whole output's text, stop strings cut it."""

import numpy as np
import pytest

from contracts.identity import read_gguf_identity
from decode_gpu.core.detokenizer import IncrementalText
from decode_gpu.model.loader import load_tokenizer

pytestmark = pytest.mark.slow  # the embedded model's tokenizer, converted once per session

@pytest.fixture(scope="module")
def tokenizer(embedded_model_path, conversion_cache):
    return load_tokenizer(read_gguf_identity(embedded_model_path), conversion_cache)


def stream(tokenizer, tokens, stop=()):
    text_state, pieces = IncrementalText(tokenizer, stop), []
    for n in range(1, len(tokens) + 1):
        pieces.append(text_state.update(tokens[:n], final=n == len(tokens)))
        if text_state.stopped:
            break
    return "".join(pieces), text_state.stopped


@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_equal_the_whole_decode(tokenizer, seed):
    rng = np.random.default_rng(seed)
    text = "Grüße aus Köln — 東京の天気は晴れ 🌤️, emoji 👩‍💻 and plain words. " * 3
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if seed % 2:  # random ids too: byte pieces that need not form valid UTF-8 until later
        tokens = [int(t) for t in rng.integers(0, tokenizer.vocab_size, size=120)]
    got, stopped = stream(tokenizer, tokens)
    assert not stopped
    assert got == tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_stop_string_cuts_the_text_even_across_tokens(tokenizer):
    tokens = tokenizer.encode("The answer is 42. END of the answer, and more text after it.",
                              add_special_tokens=False)
    got, stopped = stream(tokenizer, tokens, stop=("END of",))
    assert stopped and got == "The answer is 42. "


def test_the_end_tokens_come_from_the_tokenizer_and_the_generation_config(tokenizer):
    from types import SimpleNamespace

    from decode_gpu.model.loader import eos_token_ids
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # SmolLM2-Instruct's end of a chat turn
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    assert eos_token_ids(tokenizer, model) == (im_end,)
    model.generation_config.eos_token_id = [0, im_end]  # a list, as some configs give it
    assert eos_token_ids(tokenizer, model) == tuple(sorted({0, im_end}))
