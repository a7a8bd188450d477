"""One step's per-row sampling parameters as device tensors, built once per step from the sequences."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from decode_gpu.seeded_noise import row_keys
from contracts.handoff import SamplingParams

# below this, dividing logits by the temperature can overflow float32: such rows are greedy (vLLM's cut-off)
GREEDY_BELOW = 1e-5


def resolve_seed(params: SamplingParams) -> int:
    """The seed a request samples with, as an int64: its own, or one drawn once at admission, so that an
    unseeded row samples in the same batched op as the rest."""
    seed = params.seed if params.seed is not None else secrets.randbits(64)
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs from one sequence this step."""
    params: SamplingParams
    seed: int  # from resolve_seed
    position: int  # the position of the token being sampled: with the seed, it keys this draw's noise


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

    @classmethod
    def build(cls, rows: list[SamplingRow], device: torch.device) -> "SamplingBatch":
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
                   num_logprobs=tuple(row.params.logprobs for row in rows))

    @property
    def max_logprobs(self) -> int | None:
        """The most alternatives any row wants, None when no row wants logprobs."""
        wanted = [n for n in self.num_logprobs if n is not None]
        return max(wanted) if wanted else None
