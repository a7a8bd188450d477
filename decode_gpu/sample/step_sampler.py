"""One step's sampling: every row's parameters, banned tokens and grammar mask gathered into one batch, sampled
on the device with one device-to-host copy.

A row is (sequence, ahead): the draw at the position after the sequence's tokens and then `ahead`, the draft
tokens before it taken as accepted. Bad logits are flagged per row by the sampler; should the batched sampler
raise instead, each row is sampled alone, so that only the rows at fault fail.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from decode_gpu.core.output import StopRules
from decode_gpu.core.sequence import Sequence
from decode_gpu.sample.grammar_matchers import GrammarMatchers
from sampling.sampler import SampledRow, sample_rows
from sampling.sampling_params import SamplingBatch, SamplingRow, banned_end_tokens

log = logging.getLogger(__name__)
# On the CPU, a step of at most this many rows samples on one thread: its reductions over the vocabulary are tens of
# microseconds of work, less than a parallel region's fork and join, and far less than its wait for a descheduled
# thread on a loaded machine (torch_attention.ONE_THREAD_TOKENS says the same of the attention)
ONE_THREAD_ROWS = 4


class StepSampler:
    def __init__(self, stops: StopRules, matchers: GrammarMatchers) -> None:
        self.stops = stops
        self.matchers = matchers

    def sample(self, rows: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> list[SampledRow]:
        """Every row's token. # logits: [len(rows), vocab]"""
        threads = torch.get_num_threads() if logits.device.type == "cpu" else 1
        if threads == 1 or len(rows) > ONE_THREAD_ROWS:
            return self._sample(rows, logits)
        torch.set_num_threads(1)
        try:
            return self._sample(rows, logits)
        finally:
            torch.set_num_threads(threads)

    def _sample(self, rows: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> list[SampledRow]:
        try:
            return sample_rows(logits, self._batch(rows, logits))
        except Exception:
            log.exception("batched sampling failed; sampling each row alone")
            return [self._sample_alone(row, logits_row) for row, logits_row in zip(rows, logits)]

    def _sample_alone(self, row: tuple[Sequence, list[int]], logits: torch.Tensor) -> SampledRow:  # logits: [vocab]
        """One row through the sampler by itself: an error here becomes this row's problem."""
        try:
            return sample_rows(logits[None], self._batch([row], logits[None]))[0]
        except Exception as err:
            return SampledRow(-1, str(err) or type(err).__name__)

    def _batch(self, rows: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> SamplingBatch:
        # the position of the token being sampled keys its noise: the same seed and prompt give the same
        # tokens in any batch, after preemption, and with or without speculation
        vocab, device = logits.shape[-1], logits.device  # logits: [n, vocab]
        batch = SamplingBatch.build([self._row(seq, ahead, vocab) for seq, ahead in rows], device)
        matchers = [seq.meta.get("matcher") for seq, _ in rows]  # a structured sequence never has a draft
        if any(m is not None for m in matchers):
            batch = dataclasses.replace(batch, token_mask=self.matchers.bitmask(matchers, device))
        return batch

    def _row(self, seq: Sequence, ahead: list[int], vocab: int) -> SamplingRow:
        """The draw after seq's tokens and then `ahead`: what the step would sample there were they accepted."""
        position = len(seq.tokens) + len(ahead)
        ban = banned_end_tokens(seq.sampling, position - seq.prompt_len, tuple(self.stops.eos_token_ids), vocab)
        row = SamplingRow(seq.sampling, seq.seed, position, seq.tokens, seq.prompt_len, ban)
        # penalties count the draft tokens ahead as context (the tokens are read only by penalized rows)
        return dataclasses.replace(row, tokens=[*seq.tokens, *ahead]) if ahead and row.penalized else row
