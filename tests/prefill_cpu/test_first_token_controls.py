"""The prefill worker's first token on a real (tiny, random-weight) GGUF: llama.cpp's logits go to the shared sampler
(prefill_cpu.first_token) unchanged, with this model's end-of-generation tokens for min_tokens. What each control does
is the table of tests/sampling/test_sampling_semantics.py, run through the worker's first token and the engine alike.
"""

import dataclasses

import llama_cpp
import numpy as np
import pytest

from contracts.handoff import SamplingParams
from prefill_cpu.first_token import sample_first
from prefill_cpu.prefiller import PrefillConfig, Prefiller, PrefillRequest
from tiny_gguf import N_VOCAB

GREEDY = SamplingParams(temperature=0.0)
EOS = 2  # tiny_gguf's </s>


@pytest.fixture(scope="module")
def prefiller(tiny_gguf):
    prefiller = Prefiller(PrefillConfig(str(tiny_gguf("llama")), n_ctx=256, n_batch=64, n_threads=2, kv_type="f16"))
    yield prefiller
    prefiller.close()


def prompt(seed: int, n: int = 24) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, N_VOCAB, size=n))


def first(prefiller: Prefiller, tokens, params: SamplingParams):
    return prefiller.prefill(PrefillRequest("r", tuple(tokens), params)).handoff


def llama_logits(prefiller: Prefiller) -> np.ndarray:
    """llama.cpp's last logits, as the prefill left them. # [vocab]"""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(prefiller.ctx, -1), shape=(N_VOCAB,)).copy()


def test_the_first_tokens_are_the_shared_samplers_draws_on_llama_cpps_logits(prefiller):
    tokens = prompt(0)
    first(prefiller, tokens, GREEDY)
    raw = llama_logits(prefiller)
    eog = tuple(t for t in range(N_VOCAB) if llama_cpp.llama_vocab_is_eog(prefiller.llm._model.vocab, t))
    base = int(raw.argmax())
    params = SamplingParams(temperature=0.8, seed=11, n=3, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                            logit_bias=((base, -2.0), ((base + 7) % N_VOCAB, 1.5)), min_tokens=1, logprobs=2)
    handoff = first(prefiller, tokens, params)
    np.testing.assert_array_equal(llama_logits(prefiller), raw)  # read, never written
    got = [(handoff.first_token, handoff.first_logprob, handoff.first_top_logprobs)]
    got += [(c.token, c.logprob, c.top_logprobs) for c in handoff.other_choices]
    want = [(c.token, c.logprob, c.top_logprobs) for c in sample_first(raw, params, tokens, eog)]
    assert got == want
    assert first(prefiller, tokens, GREEDY).first_token == base


def test_min_tokens_bans_llama_cpps_end_of_generation_tokens(prefiller):
    vocab = prefiller.llm._model.vocab
    assert llama_cpp.llama_vocab_is_eog(vocab, EOS)
    to_eos = dataclasses.replace(GREEDY, logit_bias=((EOS, 100.0),))
    assert first(prefiller, prompt(1), to_eos).first_token == EOS
    held = first(prefiller, prompt(1), dataclasses.replace(to_eos, min_tokens=1)).first_token
    assert not llama_cpp.llama_vocab_is_eog(vocab, held)


def test_logit_bias_outside_the_vocabulary_is_refused_by_id(prefiller):
    with pytest.raises(ValueError, match=f"token {N_VOCAB + 5}"):
        first(prefiller, prompt(0), dataclasses.replace(GREEDY, logit_bias=((N_VOCAB + 5, 1.0),)))
    with pytest.raises(ValueError, match="token -1"):
        first(prefiller, prompt(0), dataclasses.replace(GREEDY, logit_bias=((-1, 1.0),)))
    assert first(prefiller, prompt(0), GREEDY).first_token == first(prefiller, prompt(0), GREEDY).first_token
