"""One table of sampling cases, run through both places a token is sampled: the decode engine's step (every case in
one batch, which also shows that a row's token depends on its own case only) and the prefill worker's first token
(prefill_cpu.first_token.sample_first on the same logits). Both use sampling/, so a seeded run draws the same token in
both; the table says which token, or which set of tokens a run over SEEDS seeds draws (all of them, no other).

Logits are fabricated over a vocabulary of 16; END is the model's end-of-generation token. Cases with output tokens
(presence and frequency penalties, min_tokens once tokens are out) exist only in the engine: the worker draws the
first token, before any output.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from contracts.handoff import SamplingParams
from decode_gpu.core.output import StopRules
from decode_gpu.core.sequence import Sequence
from decode_gpu.sample.step_sampler import StepSampler
from prefill_cpu.first_token import FirstTokenError, sample_first
from sampling.sampling_params import resolve_seed
from sampling.token_mask import matcher_bitmask

VOCAB = 16
END = 15
SEEDS = 48  # seeded runs of a case whose expectation is a set: each allowed token is drawn in a few of them
# 3 leads 7 by 1, 5 and 9 follow, END next, the rest at 0
BASE = (0.0, 0.0, 0.0, 4.0, 0.0, 2.5, 0.0, 3.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
TIE = (0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 5.0) + (0.0,) * 9  # 4 and 6 tie
NEGATIVE = (-1.0, -1.5) + (-4.0,) * 14  # every logit below 0: a repetition penalty multiplies
END_FIRST = BASE[:15] + (6.0,)  # the end token leads
# probabilities 0.5 (2), 0.3 (6), 0.15 (10), 0.05 over the other 13: for top-p
SKEWED = tuple(math.log({2: 0.5, 6: 0.3, 10: 0.15}.get(t, 0.05 / 13)) for t in range(VOCAB))
SAMPLED = dict(temperature=1.0)


@dataclass(frozen=True)
class Case:
    name: str
    params: dict  # SamplingParams fields
    # a token (greedy, or a pinned seeded draw); a tuple of n tokens (n choices); a set: every token that runs over
    # SEEDS seeds draw, and no other; None: nothing can be drawn (the row fails)
    expect: int | tuple[int, ...] | frozenset[int] | None
    logits: tuple[float, ...] = BASE
    prompt: tuple[int, ...] = (1, 2)
    output: tuple[int, ...] = ()  # tokens already out (the engine only)
    grammar: frozenset[int] | None = None  # what a grammar allows next


CASES = [
    # greedy and the draw
    Case("greedy takes the argmax", dict(temperature=0.0), 3),
    Case("greedy ties go to the lower id", dict(temperature=0.0), 4, logits=TIE),
    Case("a temperature below 1e-5 is greedy", dict(temperature=1e-6), 3),
    Case("greedy ignores top-k and top-p", dict(temperature=0.0, top_k=3, top_p=0.1), 3),
    Case("a seeded draw is pinned", dict(temperature=1.0, seed=42), 3),
    Case("another seed, another token", dict(temperature=1.0, seed=3), 7),
    Case("the same seed at another position", dict(temperature=1.0, seed=3), 3, prompt=(1, 2, 8, 8)),
    Case("n choices draw with choice_seed", dict(temperature=1.0, seed=5, n=3), (9, END, 9)),
    # filters
    Case("top-k keeps the k best", dict(SAMPLED, top_k=3), frozenset({3, 7, 5})),
    Case("top-p keeps the smallest set reaching it", dict(SAMPLED, top_p=0.75), frozenset({2, 6}), logits=SKEWED),
    Case("top-p counts the token that crosses it", dict(SAMPLED, top_p=0.85), frozenset({2, 6, 10}), logits=SKEWED),
    Case("top-p over what top-k kept", dict(SAMPLED, top_k=2, top_p=0.6), frozenset({2}), logits=SKEWED),
    Case("min-p drops tokens under min_p x the best", dict(SAMPLED, min_p=0.3), frozenset({3, 7})),
    Case("min-p compares the temperature-scaled probabilities", dict(temperature=2.0, min_p=0.3),
         frozenset({3, 7, 5, 9})),
    # logit_bias
    Case("logit_bias forces a token", dict(temperature=0.0, logit_bias=((11, 10.0),)), 11),
    Case("logit_bias forbids a token", dict(temperature=0.0, logit_bias=((3, -100.0),)), 7),
    Case("logit_bias adds exactly", dict(temperature=0.0, logit_bias=((7, 0.9),)), 3),
    Case("logit_bias reaches the draw", dict(SAMPLED, top_k=2, logit_bias=((11, 3.5),)), frozenset({3, 11})),
    # penalties
    Case("repetition divides a positive logit of the prompt", dict(temperature=0.0, repetition_penalty=1.5),
         7, prompt=(3,)),
    Case("repetition just short of it", dict(temperature=0.0, repetition_penalty=1.3), 3, prompt=(3,)),
    Case("repetition multiplies a negative logit", dict(temperature=0.0, repetition_penalty=2.0), 1,
         logits=NEGATIVE, prompt=(0,)),
    Case("repetition below 1 favours the prompt", dict(temperature=0.0, repetition_penalty=0.5), 7, prompt=(7,)),
    Case("repetition counts the output too", dict(temperature=0.0, repetition_penalty=1.5), 7, output=(3,)),
    Case("repetition within the draw", dict(SAMPLED, top_k=2, repetition_penalty=3.0), frozenset({7, 5}),
         prompt=(3, 3)),
    Case("presence and frequency do nothing before any output",
         dict(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0), 3, prompt=(3, 3, 3)),
    Case("presence subtracts once", dict(temperature=0.0, presence_penalty=1.5), 7, output=(3, 3)),
    Case("presence just short of it", dict(temperature=0.0, presence_penalty=0.9), 3, output=(3, 3)),
    Case("frequency subtracts per occurrence", dict(temperature=0.0, frequency_penalty=0.6), 7, output=(3, 3)),
    Case("frequency once is not enough", dict(temperature=0.0, frequency_penalty=0.6), 3, output=(3,)),
    # min_tokens
    Case("the end token wins without min_tokens", dict(temperature=0.0), END, logits=END_FIRST),
    Case("min_tokens bans the end token", dict(temperature=0.0, min_tokens=1), 3, logits=END_FIRST),
    Case("min_tokens bans the stop ids", dict(temperature=0.0, min_tokens=2, stop_token_ids=(3, 99)), 7),
    Case("min_tokens is over once that many are out", dict(temperature=0.0, min_tokens=1), END, logits=END_FIRST,
         output=(4,)),
    Case("ignore_eos leaves the end token drawable", dict(temperature=0.0, min_tokens=1, ignore_eos=True), END,
         logits=END_FIRST),
    Case("the ban beats logit_bias", dict(temperature=1.5, top_k=2, min_tokens=1, logit_bias=((END, 100.0),)),
         frozenset({3, 7})),
    # the grammar mask, after every control that changes values and before the filters
    Case("the grammar masks greedy", dict(temperature=0.0), 5, grammar=frozenset({5, 9})),
    Case("logit_bias cannot bring back what the grammar forbids", dict(temperature=0.0, logit_bias=((3, 100.0),)),
         5, grammar=frozenset({5, 9})),
    Case("top-p over what the grammar allows", dict(SAMPLED, top_p=0.9), frozenset({5, 9}),
         grammar=frozenset({0, 5, 9})),
    Case("min-p over what the grammar allows", dict(SAMPLED, min_p=0.5), frozenset({5, 9}),
         grammar=frozenset({0, 5, 9})),
    Case("the grammar and min_tokens", dict(temperature=0.0, min_tokens=1), 4, logits=END_FIRST,
         grammar=frozenset({4, END})),
    Case("nothing left to draw fails the row", dict(temperature=0.0, min_tokens=1), None, grammar=frozenset({END})),
    # logprobs: of the raw distribution, whatever the controls (checked for every case that asks)
    Case("logprobs stay raw under logit_bias", dict(temperature=0.0, logprobs=3, logit_bias=((11, 10.0),)), 11),
    Case("logprobs stay raw under the grammar", dict(temperature=1.0, seed=3, logprobs=2), 9,
         grammar=frozenset({9, 11})),
]


def runs(case: Case) -> list[SamplingParams]:
    """The case's runs: one, or one per seed when the expectation is a set."""
    params = SamplingParams(**case.params)
    if isinstance(case.expect, frozenset):
        return [dataclasses.replace(params, seed=seed) for seed in range(SEEDS)]
    return [params]


class AllowedMatcher:
    """A grammar matcher's mask side (contracts.grammar.Matcher.fill_bitmask) allowing a fixed set of tokens."""

    def __init__(self, allowed: frozenset[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        words = np.zeros(num_bytes // 4, dtype=np.uint32)
        for token in self.allowed:
            words[token // 32] |= np.uint32(1 << token % 32)
        ctypes.memmove(address, words.ctypes.data, num_bytes)


class Bitmasks:
    """In place of the engine's grammar matchers (decode_gpu.sample.grammar_matchers): the step's bitmask."""

    def bitmask(self, matchers: list, device: torch.device) -> tuple[list[int], torch.Tensor]:
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        mask = torch.zeros(len(matchers), (VOCAB + 31) // 32, dtype=torch.int32)  # [n, words]
        for row in rows:
            mask[row] = matcher_bitmask(matchers[row], VOCAB)[0]
        return rows, mask.to(device)


def sequence(case: Case, params: SamplingParams, index: int) -> Sequence:
    """Choice `index` of a request, as the engine holds it, with its seed from admission (resolve_seed)."""
    seq = Sequence(f"{case.name}/{index}", 0, 0, len(case.prompt), [*case.prompt, *case.output], params,
                   seed=resolve_seed(params, index), index=index)
    if case.grammar is not None:
        seq.meta["matcher"] = AllowedMatcher(case.grammar)
    return seq


@functools.cache
def engine_results() -> dict[str, list[list]]:
    """Every case's runs through the engine's step sampler, all in one batch: per case, per run, one SampledRow per
    choice."""
    rows, logits, where = [], [], []
    for case in CASES:
        for r, params in enumerate(runs(case)):
            for index in range(params.n):
                rows.append((sequence(case, params, index), []))
                logits.append(case.logits)
                where.append((case.name, r))
    sampler = StepSampler(StopRules(frozenset({END}), max_model_len=1024), Bitmasks())
    sampled = sampler.sample(rows, torch.tensor(logits))  # logits: [rows, VOCAB]
    results: dict[str, list[list]] = {case.name: [[] for _ in runs(case)] for case in CASES}
    for (name, r), row in zip(where, sampled):
        results[name][r].append(row)
    return results


def worker_results(case: Case) -> list[list]:
    """The case's runs through the prefill worker's first token; a FirstTokenError as None."""
    out = []
    for params in runs(case):
        logits = np.array(case.logits, dtype=np.float32)  # [VOCAB]
        grammar = AllowedMatcher(case.grammar) if case.grammar is not None else None
        try:
            out.append(sample_first(logits, params, case.prompt, (END,), grammar))
        except FirstTokenError:
            out.append(None)
    return out


def check(case: Case, tokens: list[tuple[int, ...] | None]) -> None:
    """tokens: per run, the choices' tokens (None: the run failed)."""
    if case.expect is None:
        assert tokens == [None] * len(tokens)
    elif isinstance(case.expect, frozenset):
        assert {t for run in tokens for t in run} == case.expect
    else:
        assert tokens == [case.expect if isinstance(case.expect, tuple) else (case.expect,)]


def check_logprobs(case: Case, params: SamplingParams, token: int, logprob: float | None, top) -> None:
    """Logprobs, when asked for, are the raw distribution's, before any control or mask."""
    if params.logprobs is None:
        return
    raw = torch.log_softmax(torch.tensor(case.logits, dtype=torch.float64), dim=-1)  # [VOCAB]
    assert logprob == pytest.approx(raw[token].item(), abs=1e-5)
    best = torch.topk(raw, params.logprobs)
    assert [t for t, _ in top] == best.indices.tolist()
    assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_engine_batch(case):
    results = engine_results()[case.name]
    tokens = [None if any(row.problem for row in run) else tuple(row.token for row in run) for run in results]
    check(case, tokens)
    for params, run in zip(runs(case), results):
        for row in run:
            if row.problem is None:
                check_logprobs(case, params, row.token, row.logprob, row.top)


FIRST_TOKEN_CASES = [case for case in CASES if not case.output]


@pytest.mark.parametrize("case", FIRST_TOKEN_CASES, ids=[case.name for case in FIRST_TOKEN_CASES])
def test_the_worker_first_token(case):
    results = worker_results(case)
    check(case, [None if run is None else tuple(first.token for first in run) for run in results])
    for params, run in zip(runs(case), results):
        for first in run or ():
            check_logprobs(case, params, first.token, first.logprob, first.top_logprobs)


@pytest.mark.parametrize("case", FIRST_TOKEN_CASES, ids=[case.name for case in FIRST_TOKEN_CASES])
def test_both_draw_the_same_token_for_the_same_seed_and_position(case):
    """Run for run, choice for choice: the worker's first token is the engine's draw at the prompt's length."""
    engine = [None if any(row.problem for row in run) else [row.token for row in run]
              for run in engine_results()[case.name]]
    worker = [None if run is None else [first.token for first in run] for run in worker_results(case)]
    assert worker == engine


def test_the_table_covers_every_control():
    """A control missing from the table would be one whose two paths nobody compares."""
    fields = {name for case in CASES for name in case.params}
    controls = {"temperature", "top_k", "top_p", "min_p", "seed", "n", "logit_bias", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs"}
    assert controls <= fields
    assert any(case.grammar for case in CASES) and any(case.output for case in CASES)
