"""Output controls in the batched sampler, on fabricated logits: logit_bias, the three penalties, min_p, banned end
tokens (min_tokens) and ignore_eos; each moves the distribution the documented way and touches only its row."""

import dataclasses

import pytest
import torch

from contracts.handoff import SamplingParams
from decode_gpu.engine import DecodeEngine
from fake_runner import expected_tokens, fake_handoff, make_engine
from sampling.sampler import apply_controls, sample_rows
from sampling.sampling_params import Controls, SamplingBatch, SamplingRow

VOCAB = 50
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def _logits(rows: int = 2) -> torch.Tensor:
    """Token 7 leads by 1.0 over token 3, the rest far behind. # [rows, VOCAB]"""
    logits = torch.full((rows, VOCAB), -5.0)
    logits[:, 7], logits[:, 3], logits[:, 11] = 2.0, 1.0, -1.0
    return logits


def _controlled(params: SamplingParams, tokens=(), prompt_len=0, ban=()) -> torch.Tensor:
    """Row 0 with these params, row 1 plain; the processed logits. # [2, VOCAB]"""
    rows = [SamplingRow(params, 1, len(tokens), tuple(tokens), prompt_len, tuple(ban)), SamplingRow(GREEDY, 2, 0)]
    controls = Controls.build(rows, CPU)
    assert controls is not None
    out = apply_controls(_logits(), controls)
    torch.testing.assert_close(out[1], _logits()[1])  # the plain row is untouched
    return out[0]


def _greedy(params: SamplingParams, **row) -> list[int]:
    rows = [SamplingRow(params, 1, 0, **row), SamplingRow(GREEDY, 2, 0)]
    return [r.token for r in sample_rows(_logits(), SamplingBatch.build(rows, CPU))]


def test_no_control_builds_nothing():
    assert Controls.build([SamplingRow(GREEDY, 1, 0), SamplingRow(SamplingParams(temperature=0.7), 2, 0)], CPU) is None


def test_logit_bias_adds_to_its_tokens_and_can_force_or_forbid_them():
    out = _controlled(dataclasses.replace(GREEDY, logit_bias=((3, 5.0), (11, -2.5))))
    assert out[3] == 6.0 and out[11] == -3.5 and out[7] == 2.0
    assert _greedy(dataclasses.replace(GREEDY, logit_bias=((20, 100.0),))) == [20, 7]
    assert _greedy(dataclasses.replace(GREEDY, logit_bias=((7, -100.0),))) == [3, 7]


def test_presence_and_frequency_count_generated_tokens_only():
    prompt, output = [7, 7, 7], [3, 3, 11]
    presence = _controlled(dataclasses.replace(GREEDY, presence_penalty=1.5), prompt + output, len(prompt))
    assert (presence[7], presence[3], presence[11]) == (2.0, 1.0 - 1.5, -1.0 - 1.5)  # 7 is only in the prompt
    frequency = _controlled(dataclasses.replace(GREEDY, frequency_penalty=0.5), prompt + output, len(prompt))
    assert (frequency[7], frequency[3], frequency[11]) == (2.0, 1.0 - 2 * 0.5, -1.0 - 0.5)
    # negative values encourage repetition
    encouraged = _controlled(dataclasses.replace(GREEDY, presence_penalty=-2.0), prompt + output, len(prompt))
    assert encouraged[3] == 3.0
    params = dataclasses.replace(GREEDY, frequency_penalty=0.6)
    assert _greedy(params, tokens=(1, 7, 7), prompt_len=1) == [3, 7]  # 2.0 - 1.2 < 1.0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_in_prompt_or_output():
    out = _controlled(dataclasses.replace(GREEDY, repetition_penalty=2.0), [7, 11], 1)
    assert (out[7], out[11], out[3]) == (1.0, -2.0, 1.0)  # 7 (prompt) halved, 11 (output) doubled, 3 untouched
    below_one = _controlled(dataclasses.replace(GREEDY, repetition_penalty=0.5), [3], 1)
    assert below_one[3] == 2.0  # < 1 favours repetition
    assert _greedy(dataclasses.replace(GREEDY, repetition_penalty=4.0), tokens=(7,), prompt_len=1) == [3, 7]


def test_min_p_keeps_only_tokens_at_least_that_likely_relative_to_the_best():
    params = SamplingParams(temperature=1.0, min_p=0.3)  # p(3) / p(7) = e^-1 = 0.37 stays, 11 (e^-3) goes
    rows = [SamplingRow(params, seed, 0) for seed in range(400)]
    drawn = {r.token for r in sample_rows(_logits(400), SamplingBatch.build(rows, CPU))}
    assert drawn == {3, 7}
    strict = [SamplingRow(dataclasses.replace(params, min_p=0.5), seed, 0) for seed in range(400)]
    assert {r.token for r in sample_rows(_logits(400), SamplingBatch.build(strict, CPU))} == {7}


def test_banned_tokens_are_never_drawn_even_when_biased_up():
    params = SamplingParams(temperature=1.5, logit_bias=((7, 100.0),))
    rows = [SamplingRow(params, seed, 0, ban=(7,)) for seed in range(200)]
    assert 7 not in {r.token for r in sample_rows(_logits(200), SamplingBatch.build(rows, CPU))}


def test_logprobs_stay_those_of_the_raw_distribution():
    plain = SamplingParams(temperature=0.0, logprobs=2)
    biased = dataclasses.replace(plain, logit_bias=((3, 10.0),))
    rows = [SamplingRow(plain, 1, 0), SamplingRow(biased, 1, 0)]
    first, second = sample_rows(_logits(), SamplingBatch.build(rows, CPU))
    assert (first.token, second.token) == (7, 3)
    assert second.top == first.top  # the alternatives and their logprobs are the model's own
    assert second.logprob == pytest.approx(dict(first.top)[3])


def _run(engine, handoff) -> list[int]:
    tokens = []
    for event in engine.add(handoff):
        tokens.extend(event.token_ids)
    while engine.has_work:
        for event in engine.step():
            tokens.extend(event.token_ids)
    return tokens


def test_min_tokens_bans_the_end_token_and_ignore_eos_runs_past_it():
    prompt = [5, 9, 4]
    want = expected_tokens(prompt, 8)
    eos = want[3]  # the fabricated model's 4th token plays end-of-sequence
    engine, runner = make_engine()
    engine = DecodeEngine(runner, engine.config, eos_token_ids=(eos,))
    assert _run(engine, fake_handoff("plain", prompt, 8)) == want[:4]  # ends at eos
    handoff = fake_handoff("ignore", prompt, 8)
    handoff = dataclasses.replace(handoff, sampling=dataclasses.replace(handoff.sampling, ignore_eos=True))
    assert _run(engine, handoff) == want  # all 8, eos included
    handoff = fake_handoff("min", prompt, 8)
    handoff = dataclasses.replace(handoff, sampling=dataclasses.replace(handoff.sampling, min_tokens=6))
    got = _run(engine, handoff)
    assert got[:3] == want[:3] and got[3] != eos and eos not in got[:6]


def test_a_grammar_mask_constrains_its_rows_only():
    bitmask = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)  # row 1's (all zero) must not be applied
    bitmask[0, 0] = 1 << 3 | 1 << 11  # row 0 may take tokens 3 and 11 only
    batch = SamplingBatch.build([SamplingRow(GREEDY, 1, 0), SamplingRow(GREEDY, 2, 0)], CPU)
    batch = dataclasses.replace(batch, token_mask=([0], bitmask))
    assert [r.token for r in sample_rows(_logits(), batch)] == [3, 7]
    sampled = [SamplingRow(SamplingParams(temperature=2.0), seed, 0) for seed in range(100)]
    batch = dataclasses.replace(SamplingBatch.build(sampled, CPU),
                                token_mask=(list(range(100)), bitmask[:1].expand(100, -1).contiguous()))
    assert {r.token for r in sample_rows(_logits(100), batch)} == {3, 11}
