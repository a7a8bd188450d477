"""Decode one sequence from an imported (or torch-computed) dense KV cache.

The paged, batched engine replaces this for serving; this stays as the reference path that tests and
`edge check-model` compare handoff imports (and the engine) against.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from contracts.handoff import SamplingParams
from sampling.sampler import make_generator, sample_token


@torch.inference_mode()
def prompt_cache(model: PreTrainedModel, prompt_tokens: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    """torch's own prefill: the prompt's KV and its last logits. # logits: [vocab]"""
    ids = torch.tensor([prompt_tokens], device=model.device)
    out = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True)
    return out.cache, out.logits[0, -1]


@torch.inference_mode()
def decode(model: PreTrainedModel, cache: DynamicCache, first_token: int, n_new: int,
           params: SamplingParams = SamplingParams(temperature=0.0)) -> list[int]:
    """Generate n_new tokens after the cached prompt; first_token is the prefill's sample, fed first."""
    generator = make_generator(params, model.device)
    tokens = [first_token]
    while len(tokens) < n_new:
        logits = _step(model, cache, tokens[-1])
        tokens.append(sample_token(logits, params, generator))
    return tokens[:n_new]


@torch.inference_mode()
def teacher_forced_logits(model: PreTrainedModel, cache: DynamicCache, tokens: list[int]) -> torch.Tensor:
    """Logits after each of tokens, fed after the cached prompt. # [len(tokens), vocab]"""
    start = cache.get_seq_length()
    ids = torch.tensor([tokens], device=model.device)
    positions = torch.arange(start, start + len(tokens), device=model.device)[None]
    out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
    return out.logits[0].float()


def _step(model: PreTrainedModel, cache: DynamicCache, token: int) -> torch.Tensor:
    position = cache.get_seq_length()
    out = model(input_ids=torch.tensor([[token]], device=model.device),
                position_ids=torch.tensor([[position]], device=model.device),
                cache=cache, use_cache=True)
    return out.logits[0, -1]
