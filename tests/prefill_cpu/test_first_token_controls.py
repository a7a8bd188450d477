"""The output controls on the first token, which the prefill worker samples with llama.cpp.

The decode engine applies the same controls to every later token; a first token that ignored them would be the
one token of a reply that a logit_bias, a repetition penalty or min_tokens did not reach. Greedy cases compare
with a numpy reference of the documented order (min_tokens ban, logit_bias, repetition penalty, argmax).
"""

import dataclasses

import llama_cpp
import numpy as np
import pytest

from contracts.handoff import SamplingParams
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


def raw_logits(prefiller: Prefiller, tokens) -> np.ndarray:
    """The model's own last logits for a prompt, read from llama.cpp after a prefill without controls. # [vocab]"""
    first(prefiller, tokens, GREEDY)
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(prefiller.ctx, -1), shape=(N_VOCAB,)).copy()


def reference_greedy(raw: np.ndarray, params: SamplingParams, tokens, eog: list[int]) -> int:
    """The documented order before temperature, in float64, then the argmax."""
    logits = raw.astype(np.float64)  # [vocab]
    if params.min_tokens >= 1:
        logits[eog + [t for t in params.stop_token_ids if t < len(logits)]] = -np.inf
    for token, bias in params.logit_bias:
        logits[token] += bias
    seen = sorted(set(tokens))
    r = params.repetition_penalty
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / r, logits[seen] * r)
    return int(logits.argmax())


def eog_ids(prefiller: Prefiller) -> list[int]:
    vocab = prefiller.llm._model.vocab
    return [t for t in range(N_VOCAB) if llama_cpp.llama_vocab_is_eog(vocab, t)]


def test_logit_bias_moves_the_greedy_first_token(prefiller):
    tokens = prompt(0)
    base = first(prefiller, tokens, GREEDY).first_token
    target = (base + 17) % N_VOCAB
    biased = dataclasses.replace(GREEDY, logit_bias=((target, 100.0),))
    assert first(prefiller, tokens, biased).first_token == target
    banned = dataclasses.replace(GREEDY, logit_bias=((base, -100.0),))
    assert first(prefiller, tokens, banned).first_token != base
    raw = raw_logits(prefiller, tokens)
    small = dataclasses.replace(GREEDY, logit_bias=((base, -0.5), (target, 0.25), (int(raw.argsort()[-2]), 0.75)))
    assert first(prefiller, tokens, small).first_token == reference_greedy(raw, small, tokens, [])


def test_logit_bias_reaches_the_sampled_first_token(prefiller):
    tokens = prompt(0)
    base = first(prefiller, tokens, GREEDY).first_token
    target = (base + 17) % N_VOCAB
    for seed in range(5):
        params = SamplingParams(temperature=1.0, seed=seed, logit_bias=((target, 100.0),))
        assert first(prefiller, tokens, params).first_token == target


def test_logit_bias_outside_the_vocabulary_is_refused_by_id(prefiller):
    with pytest.raises(ValueError, match=f"token {N_VOCAB + 5}"):
        first(prefiller, prompt(0), dataclasses.replace(GREEDY, logit_bias=((N_VOCAB + 5, 1.0),)))
    with pytest.raises(ValueError, match="token -1"):
        first(prefiller, prompt(0), dataclasses.replace(GREEDY, logit_bias=((-1, 1.0),)))
    assert first(prefiller, prompt(0), GREEDY).first_token == first(prefiller, prompt(0), GREEDY).first_token


def penalized_prompt(prefiller: Prefiller) -> tuple[tuple[int, ...], np.ndarray]:
    """A prompt whose greedy first token is one of its own tokens, and some token outside it has a positive logit
    (a repetition penalty only scales a positive logit toward 0, so that token must be there to win)."""
    for seed in range(200):
        tokens = prompt(seed, n=60)
        raw = raw_logits(prefiller, tokens)
        outside = np.setdiff1d(np.arange(N_VOCAB), tokens)
        if int(raw.argmax()) in tokens and raw[outside].max() > 0:
            return tokens, raw
    raise AssertionError("no prompt of the tiny model repeats its own token")


def test_repetition_penalty_steers_the_first_token_off_the_prompt(prefiller):
    tokens, raw = penalized_prompt(prefiller)
    assert first(prefiller, tokens, GREEDY).first_token in tokens
    huge = dataclasses.replace(GREEDY, repetition_penalty=1e6)
    got = first(prefiller, tokens, huge).first_token
    assert got not in tokens
    assert got == reference_greedy(raw, huge, tokens, [])
    for r in (0.5, 1.3, 3.0):  # below 1 favours the prompt's tokens; each against the vLLM formula
        params = dataclasses.replace(GREEDY, repetition_penalty=r)
        assert first(prefiller, tokens, params).first_token == reference_greedy(raw, params, tokens, [])
    # every logit pushed below 0 by logit_bias (applied first): a penalty now multiplies, so the prompt's tokens sink
    shift = float(raw.max()) + 1.0
    assert shift <= 100.0  # within OpenAI's bias range
    negative = dataclasses.replace(huge, logit_bias=tuple((t, -shift) for t in range(N_VOCAB)))
    got = first(prefiller, tokens, negative).first_token
    assert got not in tokens and got == reference_greedy(raw, negative, tokens, [])


def test_presence_and_frequency_penalties_do_not_touch_the_first_token(prefiller):
    tokens, _ = penalized_prompt(prefiller)
    params = dataclasses.replace(GREEDY, presence_penalty=2.0, frequency_penalty=2.0)
    assert first(prefiller, tokens, params).first_token == first(prefiller, tokens, GREEDY).first_token


def test_min_tokens_bans_the_end_and_stop_tokens(prefiller):
    assert EOS in eog_ids(prefiller)
    tokens = prompt(1)
    to_eos = dataclasses.replace(GREEDY, logit_bias=((EOS, 100.0),))
    assert first(prefiller, tokens, to_eos).first_token == EOS
    held = first(prefiller, tokens, dataclasses.replace(to_eos, min_tokens=1)).first_token
    assert held != EOS and held not in eog_ids(prefiller)
    raw = raw_logits(prefiller, tokens)
    stop = int(raw.argmax())
    stops = dataclasses.replace(GREEDY, stop_token_ids=(stop, N_VOCAB + 3), logit_bias=((stop, 5.0),))
    assert first(prefiller, tokens, stops).first_token == stop
    banned = dataclasses.replace(stops, min_tokens=4)
    got = first(prefiller, tokens, banned).first_token
    assert got != stop and got == reference_greedy(raw, banned, tokens, eog_ids(prefiller))
    sampled = SamplingParams(temperature=1.0, min_tokens=1, logit_bias=((EOS, 100.0),))
    assert all(first(prefiller, tokens, dataclasses.replace(sampled, seed=s)).first_token != EOS for s in range(5))


def test_logprobs_stay_those_of_the_raw_distribution(prefiller):
    tokens = prompt(2)
    plain = first(prefiller, tokens, dataclasses.replace(GREEDY, logprobs=N_VOCAB))
    raw = dict(plain.first_top_logprobs)
    target = 3 + (plain.first_token + 5) % (N_VOCAB - 3)  # not <unk> <s> </s> (min_tokens bans </s>)
    controls = dict(logprobs=N_VOCAB, logit_bias=((target, 100.0),), repetition_penalty=2.0, min_tokens=1)
    biased = first(prefiller, tokens, dataclasses.replace(GREEDY, **controls))
    assert biased.first_token == target
    assert biased.first_logprob == raw[target] < raw[plain.first_token]
    assert biased.first_top_logprobs == plain.first_top_logprobs


def test_min_p_near_one_keeps_only_the_argmax(prefiller):
    tokens = prompt(3)
    raw = raw_logits(prefiller, tokens)
    top2 = np.sort(raw)[-2:]
    assert np.exp(top2[0] - top2[1]) < 0.99  # no near tie at temperature 1
    argmax = int(raw.argmax())
    drawn = {first(prefiller, tokens, SamplingParams(temperature=1.0, seed=s)).first_token for s in range(30)}
    assert drawn != {argmax}  # without min_p, temperature 1 does draw others
    for seed in range(30):
        assert first(prefiller, tokens, SamplingParams(temperature=1.0, seed=seed, min_p=0.99)).first_token == argmax


def test_min_p_compares_the_temperature_scaled_probabilities(prefiller):
    """Between the top two, a min_p that the runner-up misses at temperature 1 but passes at a high temperature:
    the runner-up is drawn only if min_p comes after temperature."""
    tokens = prompt(3)
    raw = raw_logits(prefiller, tokens)
    order = np.argsort(-raw)
    gap = float(raw[order[0]] - raw[order[1]])
    temperature = gap / np.log(2.0)  # the runner-up has half the best one's probability after temperature
    min_p = float(np.sqrt(np.exp(-gap) * 0.5))  # between the ratio at temperature 1 and the scaled 0.5
    params = SamplingParams(temperature=temperature, top_k=2, min_p=min_p)
    drawn = {first(prefiller, tokens, dataclasses.replace(params, seed=s)).first_token for s in range(30)}
    assert drawn == {int(order[0]), int(order[1])}
