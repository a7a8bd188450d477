"""How a draw's noise is keyed: by its choice's seed (the request's seed for choice 0, contracts.handoff.choice_seed
for the others, wrapped to int64 by resolve_seed) and the position it samples. The prefill worker's first token and
the decode engine's steps build the same key for the same (seed, choice, position), and no two (seed, choice,
position) of a request share one, so no choice replays another's noise shifted by a few positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import decode_gpu.sample.step_sampler as step_sampler
import prefill_cpu.first_token as first_token
from contracts.handoff import SamplingParams, choice_seed
from decode_gpu.core.output import StopRules
from decode_gpu.core.sequence import Sequence
from decode_gpu.sample.step_sampler import StepSampler
from sampling.sampling_params import resolve_seed
from sampling.seeded_noise import row_keys

VOCAB, END = 32, 31
PROMPT = (1, 2, 3, 4, 5)
PARAMS = SamplingParams(temperature=1.0, seed=1234, n=4)


@pytest.fixture
def keys(monkeypatch) -> list[list[int]]:
    """Each batch's noise keys, as the worker's first token and the engine's step sample it."""
    seen: list[list[int]] = []
    for module in (first_token, step_sampler):
        sample_rows = module.sample_rows
        monkeypatch.setattr(module, "sample_rows",
                            lambda logits, batch, f=sample_rows: seen.append(batch.keys.tolist()) or f(logits, batch))
    return seen


def expected(params: SamplingParams, positions: list[int]) -> list[int]:
    seeds = torch.tensor([resolve_seed(params, i) for i in range(len(positions))])
    return row_keys(seeds, torch.tensor(positions)).tolist()


def engine_choices(params: SamplingParams, outputs: int) -> list[Sequence]:
    """The request's choices as admission makes them (seed: ModelSide.seed_for, which is resolve_seed), each with
    `outputs` tokens out."""
    return [Sequence(f"r#{i}", 0, 0, len(PROMPT), [*PROMPT, *range(6, 6 + outputs)], params,
                     seed=resolve_seed(params, i), index=i) for i in range(params.n)]


def test_the_worker_and_the_engine_key_a_choice_and_position_alike(keys):
    logits = np.zeros(VOCAB, dtype=np.float32)
    first_token.sample_first(logits, PARAMS, PROMPT, (END,))
    sampler = StepSampler(StopRules(frozenset({END}), max_model_len=1024), matchers=None)
    sampler.sample([(seq, []) for seq in engine_choices(PARAMS, 0)], torch.zeros(PARAMS.n, VOCAB))
    # the worker's first token is choice i's draw at the prompt's length, as the engine would draw it there
    assert keys[0] == keys[1] == expected(PARAMS, [len(PROMPT)] * PARAMS.n)


def test_later_draws_and_drafts_continue_each_choices_stream_by_position(keys):
    sampler = StepSampler(StopRules(frozenset({END}), max_model_len=1024), matchers=None)
    seqs = engine_choices(PARAMS, 3)  # the first token and two more out: the next draw is at prompt length + 3
    sampler.sample([(seq, [7, 8][:i % 3]) for i, seq in enumerate(seqs)], torch.zeros(PARAMS.n, VOCAB))
    assert keys[0] == expected(PARAMS, [len(PROMPT) + 3 + i % 3 for i in range(PARAMS.n)])


def test_choice_seeds_follow_the_request_seed_and_wrap_to_int64():
    assert resolve_seed(PARAMS, 0) == 1234  # choice 0 samples as a lone request with the seed
    assert [resolve_seed(PARAMS, i) for i in range(1, 4)] == \
        [(choice_seed(1234, i) + 2**63) % 2**64 - 2**63 for i in range(1, 4)]
    # a seed past int64 (JSON has no bounds) and its int64 alias give the same noise
    assert resolve_seed(SamplingParams(seed=2**64 - 1, n=2), 1) == resolve_seed(SamplingParams(seed=-1, n=2), 1)


@pytest.mark.parametrize("seed", [0, 1, -1, 1234, 2**63 - 1])
def test_no_two_choices_or_positions_of_a_request_share_a_key(seed):
    params = SamplingParams(temperature=1.0, seed=seed, n=8)
    seeds = torch.tensor([resolve_seed(params, i) for i in range(params.n)])  # [8]
    positions = torch.arange(4096)  # [4096]
    grid = row_keys(seeds[:, None].expand(-1, len(positions)).reshape(-1), positions.repeat(params.n))
    assert len(set(grid.tolist())) == params.n * len(positions)
