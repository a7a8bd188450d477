"""A batch's per-row sampling parameters as tensors, built once per step from the sequences (or once per prompt
for the first tokens), and the one rule of which tokens min_tokens bans."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contracts.handoff import GREEDY_BELOW, SamplingParams, choice_seed
from sampling.seeded_noise import row_keys


def resolve_seed(params: SamplingParams, index: int = 0) -> int:
    """The seed choice `index` of a request samples with, as an int64: from its own (contracts.handoff.choice_seed),
    or one drawn once at admission, so that an unseeded row samples in the same batched op as the rest."""
    seed = choice_seed(params.seed, index)
    seed = seed if seed is not None else secrets.randbits(64)
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


def banned_end_tokens(params: SamplingParams, num_output: int, end_token_ids: Sequence[int],
                      vocab_size: int) -> tuple[int, ...]:
    """The tokens a draw may not take because they would end the answer before min_tokens are out: the stop ids and
    the model's end tokens (those only without ignore_eos, with which they end nothing). num_output: the tokens out
    before this draw; ids outside the vocabulary cannot be drawn anyway."""
    if num_output >= params.min_tokens:
        return ()
    ends = {*params.stop_token_ids, *(() if params.ignore_eos else end_token_ids)}
    return tuple(sorted(t for t in ends if 0 <= t < vocab_size))


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs from one sequence this step."""
    params: SamplingParams
    seed: int  # from resolve_seed
    position: int  # the position of the token being sampled: with the seed, it keys this draw's noise
    tokens: Sequence[int] = ()  # prompt then output tokens so far (read only when a penalty is on)
    prompt_len: int = 0
    ban: tuple[int, ...] = ()  # token ids this draw may not take (banned_end_tokens)

    @property
    def penalized(self) -> bool:
        p = self.params
        return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


@dataclass(frozen=True)
class Controls:
    """The output controls of the rows that use them, as device tensors (sampler.apply_controls)."""
    ban_rows: torch.Tensor  # [n_ban] int64 row of each banned (row, token) pair
    ban_ids: torch.Tensor  # [n_ban] int64
    bias_rows: torch.Tensor  # [n_bias] int64
    bias_ids: torch.Tensor  # [n_bias] int64
    bias: torch.Tensor  # [n_bias] float32
    penalty_rows: torch.Tensor  # [m] int64 rows with a penalty
    presence: torch.Tensor  # [m] float32
    frequency: torch.Tensor  # [m] float32
    repetition: torch.Tensor  # [m] float32
    output_ids: torch.Tensor  # [m, longest output] int64, padded with -1
    context_ids: torch.Tensor  # [m, longest prompt + output] int64, padded with -1
    min_p: torch.Tensor | None  # [n] float32, None when no row sets it

    @classmethod
    def build(cls, rows: list[SamplingRow], device: torch.device) -> Controls | None:
        """None when no row uses any control (the common case: no tensor is made)."""
        penalized = [i for i, row in enumerate(rows) if row.penalized]
        if not (penalized or any(row.ban or row.params.logit_bias or row.params.min_p > 0 for row in rows)):
            return None
        ban = [(i, t) for i, row in enumerate(rows) for t in row.ban]
        bias = [(i, t, b) for i, row in enumerate(rows) for t, b in row.params.logit_bias]
        outputs = [list(rows[i].tokens[rows[i].prompt_len:]) for i in penalized]
        contexts = [list(rows[i].tokens) for i in penalized]
        params = [rows[i].params for i in penalized]
        as_long = functools.partial(torch.tensor, dtype=torch.int64)
        return cls(
            ban_rows=as_long([i for i, _ in ban]).to(device), ban_ids=as_long([t for _, t in ban]).to(device),
            bias_rows=as_long([i for i, _, _ in bias]).to(device), bias_ids=as_long([t for _, t, _ in bias]).to(device),
            bias=torch.tensor([b for _, _, b in bias], dtype=torch.float32).to(device),
            penalty_rows=as_long(penalized).to(device),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32).to(device),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32).to(device),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32).to(device),
            output_ids=_padded(outputs).to(device), context_ids=_padded(contexts).to(device),
            min_p=(torch.tensor([row.params.min_p for row in rows], dtype=torch.float32).to(device)
                   if any(row.params.min_p > 0 for row in rows) else None))


def _padded(lists: list[list[int]]) -> torch.Tensor:
    """Ragged token lists as one [len(lists), longest] int64 tensor, padded with -1."""
    width = max((len(x) for x in lists), default=0)
    out = torch.full((len(lists), width), -1, dtype=torch.int64)
    for i, x in enumerate(lists):
        out[i, :len(x)] = torch.tensor(x, dtype=torch.int64)
    return out


@dataclass(frozen=True)
class SamplingBatch:
    temperature: torch.Tensor  # [n] float32; 1 on greedy rows (their noise is off instead)
    top_p: torch.Tensor  # [n] float32; 1 is off
    top_k: torch.Tensor  # [n] int64; 0 is off
    random: torch.Tensor  # [n] float32: 1 where the row samples, 0 where it is greedy
    keys: torch.Tensor  # [n] int64: the noise key of each row's draw
    # host facts, known without asking the device: a batch that needs no noise or no filter skips it
    any_random: bool
    any_filter: bool
    num_logprobs: tuple[int | None, ...]  # per row: alternatives wanted, None for no logprobs
    controls: Controls | None = None  # logit_bias, penalties, min_p, banned end tokens; None when unused
    # structured outputs: the constrained rows, and the batch's bitmask [n, ceil(vocab / 32)] int32 of allowed tokens
    token_mask: tuple[list[int], torch.Tensor] | None = None

    @classmethod
    def build(cls, rows: list[SamplingRow], device: torch.device) -> SamplingBatch:
        # "not below" rather than ">=": a NaN temperature samples, and is flagged, instead of passing as greedy
        random = [not row.params.temperature < GREEDY_BELOW for row in rows]
        floats = torch.tensor([[row.params.temperature if r else 1.0, row.params.top_p, float(r)]
                               for row, r in zip(rows, random)], dtype=torch.float32)  # [n, 3]
        ints = torch.tensor([[row.params.top_k, row.seed, row.position] for row in rows],
                            dtype=torch.int64)  # [n, 3]
        floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
        return cls(temperature=floats[:, 0], top_p=floats[:, 1], top_k=ints[:, 0], random=floats[:, 2],
                   keys=row_keys(ints[:, 1], ints[:, 2]), any_random=any(random),
                   any_filter=any(r and (row.params.top_k > 0 or row.params.top_p < 1.0)
                                  for row, r in zip(rows, random)),
                   num_logprobs=tuple(row.params.logprobs for row in rows), controls=Controls.build(rows, device))

    @property
    def max_logprobs(self) -> int | None:
        """The most alternatives any row wants, None when no row wants logprobs."""
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None
