"""Each choice's first output token, drawn by the decode engine's own batched sampler (sampling/) on the prompt's
last logits: one row per choice, seeded with that choice's seed and keyed by position = the prompt's length, so a
seeded first token comes from the same counter-based noise as every later token, and every control (min_tokens,
logit_bias, the penalties, the grammar mask, temperature, min-p, top-k, top-p) is the one definition both use.

No llama.cpp here: the prefiller passes a view of llama.cpp's logits, which are read, never written (logprobs are
of the model's raw distribution). torch runs on one host thread: the cores are llama.cpp's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from contracts.handoff import FirstToken, SamplingParams
from sampling.sampler import sample_rows
from sampling.sampling_params import SamplingBatch, SamplingRow, banned_end_tokens, resolve_seed
from sampling.token_mask import matcher_bitmask

if TYPE_CHECKING:
    from contracts.grammar import Matcher

HOST = torch.device("cpu")


class FirstTokenError(FloatingPointError):
    """The prompt's logits could not be sampled (NaN or infinite logits, or nothing left to draw)."""


def sample_first(logits: np.ndarray, params: SamplingParams, prompt_tokens: Sequence[int],
                 end_token_ids: Sequence[int], grammar: Matcher | None = None) -> list[FirstToken]:
    """params.n first tokens from one prompt's last logits, choice i with resolve_seed(params, i), as the decode
    engine draws the token at position len(prompt_tokens). end_token_ids: what min_tokens bans besides the stop ids;
    grammar: a matcher at its start (None: unconstrained). # logits: [vocab] float32"""
    view = torch.from_numpy(logits)  # [vocab]: no copy
    vocab, position = view.shape[0], len(prompt_tokens)
    ban = banned_end_tokens(params, 0, end_token_ids, vocab)
    rows = [SamplingRow(params, resolve_seed(params, i), position, tuple(prompt_tokens), position, ban)
            for i in range(params.n)]
    batch = SamplingBatch.build(rows, HOST)
    if grammar is not None:  # one state for every choice: the same mask on each row
        mask = matcher_bitmask(grammar, vocab).expand(params.n, -1)  # [n, words] int32
        batch = dataclasses.replace(batch, token_mask=(list(range(params.n)), mask))
    with _one_thread():
        sampled = sample_rows(view[None].expand(params.n, -1), batch)  # logits: [n, vocab], one view per choice
    problems = {row.problem for row in sampled if row.problem is not None}
    if problems:
        raise FirstTokenError("; ".join(sorted(problems)))
    return [FirstToken(row.token, row.logprob, row.top) for row in sampled]



@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op pool would start a thread per core and leave them spinning after each op, taking the cores
    from llama.cpp's next prompt; one thread samples a few rows in milliseconds. The count is put back after, so a
    process that also decodes with torch (a benchmark) keeps its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
