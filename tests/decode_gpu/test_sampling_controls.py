"""The output controls in the engine beyond one draw: a batch that uses none builds nothing, and min_tokens and
ignore_eos decide where an answer ends. What each control does to a token is the table of
tests/sampling/test_sampling_semantics.py, run through both the engine and the prefill worker."""

import dataclasses

import torch

from contracts.handoff import SamplingParams
from decode_gpu.engine import DecodeEngine
from fake_runner import expected_tokens, fake_handoff, make_engine
from sampling.sampling_params import Controls, SamplingRow

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def test_no_control_builds_nothing():
    assert Controls.build([SamplingRow(GREEDY, 1, 0), SamplingRow(SamplingParams(temperature=0.7), 2, 0)], CPU) is None


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
