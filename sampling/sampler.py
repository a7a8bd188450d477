"""Next-token choice for a whole batch: the output controls, the grammar mask, temperature, min-p, top-k, top-p,
seeded noise, logprobs. The one implementation of these: the decode engine samples each step's rows with it on the
device, the prefill worker each choice's first token on the host (a torch view of llama.cpp's logits).

The order, per row (`sample`): logit_bias adds, the repetition penalty scales, presence and frequency penalties
subtract, min_tokens bans the end tokens (-inf, whatever came before), the grammar mask removes what it forbids
(the last step that changes values, so no control brings a forbidden token back), then temperature scales, min-p,
top-k and top-p drop tokens (of those the mask left), and the seeded draw picks.
Everything runs as batched tensor ops, and the host reads the result with one device-to-host copy per step
(`sample_rows`). A row whose logits cannot be sampled is flagged, not raised, so it fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contracts.handoff import SamplingParams
from sampling.sampling_params import Controls, SamplingBatch, SamplingRow, resolve_seed
from sampling.seeded_noise import race_noise
from sampling.token_mask import apply_mask

# what a row's problem code means; 0 is none
PROBLEMS = {1: "the model produced NaN logits", 2: "the model produced infinite logits",
            3: "no token could be sampled: every score is -inf or NaN after temperature, top-k and top-p"}
_MAX_EXACT_ID = 1 << 24  # token ids travel to the host as float32, exact up to here
NOISE_ROWS = 64  # rows whose noise is made at once


@dataclass(frozen=True)
class SampledRow:
    """One row's result on the host."""
    token: int
    problem: str | None  # why this row could not be sampled (then token means nothing)
    logprob: float | None = None  # the token's log-probability under the model's raw distribution
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob) alternatives, best first


def sample_rows(logits: torch.Tensor, batch: SamplingBatch) -> list[SampledRow]:
    """Sample every row and bring the result to the host. # logits: [n, vocab] float"""
    packed = sample_packed(logits, batch)  # [n, 2 + logprob columns] float32
    return unpack(packed.tolist(), batch.num_logprobs)  # the step's one device-to-host copy


def sample_packed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """On the device: per row the token, its problem code, then (when any row asks) its logprob and the top
    alternatives' ids and logprobs, packed in one tensor so that one copy brings all of it. # [n, columns]"""
    if logits.shape[-1] > _MAX_EXACT_ID:
        raise ValueError(f"a vocabulary of {logits.shape[-1]} ids does not fit the sampler's float32 packing")
    tokens, codes = sample(logits, batch)  # [n] int64 each
    columns = [tokens.float()[:, None], codes.float()[:, None]]  # [n, 1] each
    if batch.max_logprobs is not None:
        columns.append(logprob_columns(logits, tokens, batch.max_logprobs))
    return torch.cat(columns, dim=1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and problem codes. # logits: [n, vocab]; results: [n] int64 each"""
    logits = logits.float()  # [n, vocab]
    controls = batch.controls
    processed = apply_controls(logits, controls) if controls is not None else logits  # [n, vocab]
    if batch.token_mask is not None:  # structured outputs: what the grammar does not allow cannot be drawn
        processed = processed.clone() if processed is logits else processed  # logprobs keep the raw logits
        apply_mask(processed, batch.token_mask)
    if batch.any_random:
        scores = processed / batch.temperature[:, None]  # [n, vocab]
        if controls is not None and controls.min_p is not None:
            scores = min_p_filter(scores, controls.min_p)
        if batch.any_filter:
            scores = filter_scores(scores, batch)
        _add_noise(scores, batch)
    else:
        scores = processed
    tokens = scores.argmax(dim=-1)  # [n]: the first of tied maxima, so greedy ties go to the lowest id
    chosen = scores.gather(1, tokens[:, None])[:, 0]  # [n]
    return tokens, _problem_codes(logits, chosen)


def apply_controls(logits: torch.Tensor, controls: Controls) -> torch.Tensor:
    """logit_bias, then the penalties, then the banned end tokens (-inf whatever came before), on a copy of the raw
    logits (logprobs keep the raw ones). # logits: [n, vocab] float32 -> [n, vocab]"""
    out = logits.clone()
    out.index_put_((controls.bias_rows, controls.bias_ids), controls.bias, accumulate=True)
    if controls.penalty_rows.numel():
        rows = out[controls.penalty_rows]  # [m, vocab]
        vocab = rows.shape[-1]
        in_context = _counts(controls.context_ids, vocab) > 0  # [m, vocab]: in the prompt or output
        rep = controls.repetition[:, None]  # [m, 1]
        rows = torch.where(in_context, torch.where(rows > 0, rows / rep, rows * rep), rows)
        generated = _counts(controls.output_ids, vocab)  # [m, vocab]
        rows = rows - controls.frequency[:, None] * generated - controls.presence[:, None] * (generated > 0)
        out[controls.penalty_rows] = rows
    out[controls.ban_rows, controls.ban_ids] = float("-inf")
    return out


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """How often each token occurs in each row of ids (padded with -1). # ids: [m, L] -> [m, vocab] float32"""
    counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)  # the last column takes the padding
    counts.scatter_add_(1, torch.where(ids < 0, vocab, ids), torch.ones(ids.shape, device=ids.device))
    return counts[:, :vocab]


def min_p_filter(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p x the likeliest one. # scores: [n, vocab] temperature-scaled; min_p: [n]"""
    probs = torch.softmax(scores, dim=-1)  # [n, vocab]
    floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [n, 1]
    return scores.masked_fill(probs < floor, float("-inf"))


def _add_noise(scores: torch.Tensor, batch: SamplingBatch) -> None:
    """scores += noise, in place, for the rows that sample; greedy rows get none, and so take the argmax of
    their logits, as top-k/top-p never drop the best token. # scores: [n, vocab]"""
    # by row chunks: the noise's int64 scratch is 20 bytes per (row, token), too much for a whole large batch
    for start in range(0, scores.shape[0], NOISE_ROWS):
        end = start + NOISE_ROWS
        noise = race_noise(batch.keys[start:end], scores.shape[-1])  # [rows of the chunk, vocab]
        scores[start:end].addcmul_(noise, batch.random[start:end, None])


def _problem_codes(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """1: NaN logits, 2: +inf logits, 3: the chosen token's score is not finite (every token masked, or a
    parameter made NaN), else 0. # logits: [n, vocab]; chosen: [n]; result: [n] int64"""
    peak = logits.amax(dim=-1)  # [n]: NaN if any logit is NaN (amax propagates NaN)
    codes = torch.where(chosen.isfinite(), 0, 3)  # [n]
    codes = torch.where(peak == float("inf"), 2, codes)
    return torch.where(peak.isnan(), 1, codes)


def filter_scores(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k, then top-p over what top-k kept; dropped tokens get -inf. # scores: [n, vocab], temperature-scaled"""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)  # [n, vocab] each
    rank = torch.arange(scores.shape[-1], device=scores.device)  # [vocab]
    # by rank, not by value: exactly k tokens even when the k-th ties with the next, the lower ids first
    drop = (rank >= batch.top_k[:, None]) & (batch.top_k[:, None] > 0)  # [n, vocab] sorted order
    probs = torch.softmax(sorted_scores.masked_fill(drop, float("-inf")), dim=-1)  # [n, vocab]
    mass_before = probs.cumsum(dim=-1) - probs  # [n, vocab]
    # the smallest set whose mass reaches top_p: a token goes once the better ones already reach it; the best
    # token always stays
    drop |= (mass_before >= batch.top_p[:, None]) & (rank > 0)
    drop_by_id = torch.empty_like(drop).scatter_(1, order, drop)  # [n, vocab] vocabulary order
    return scores.masked_fill(drop_by_id, float("-inf"))


def logprob_columns(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The sampled token's logprob, then the k best ids, then their logprobs, under the model's raw
    distribution (before temperature and filters, as OpenAI reports them). # [n, 1 + 2k] float32"""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    columns = [logprobs.gather(1, tokens[:, None])]  # [n, 1]
    if k > 0:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)  # values, indices: [n, k]
        columns += [top.indices.float(), top.values]
    return torch.cat(columns, dim=1)


def unpack(packed: list[list[float]], num_logprobs: tuple[int | None, ...]) -> list[SampledRow]:
    """Host rows from `sample_packed`'s columns; each row keeps the alternatives it asked for."""
    width = (len(packed[0]) - 3) // 2 if packed and len(packed[0]) > 2 else 0
    return [_row(values, n_top, width) for values, n_top in zip(packed, num_logprobs)]


def _row(values: list[float], n_top: int | None, width: int) -> SampledRow:
    problem = PROBLEMS.get(int(values[1]))
    if n_top is None:
        return SampledRow(int(values[0]), problem)
    ids, logprobs = values[3:3 + width][:n_top], values[3 + width:][:n_top]
    return SampledRow(int(values[0]), problem, values[2], tuple(zip(map(int, ids), logprobs)))


@dataclass
class SeedStream:
    """One sequence's seed and draws so far: what the single-sequence reference decoder keeps between tokens."""
    seed: int
    draws: int = 0


def make_generator(params: SamplingParams, device: torch.device | None = None) -> SeedStream:
    """The single-sequence API (decode_gpu.reference.dense_decoder): the device is unused, noise is counter-based."""
    return SeedStream(resolve_seed(params))


def sample_token(logits: torch.Tensor, params: SamplingParams, stream: SeedStream | None) -> int:
    """One sequence's next token, through the batched sampler. # logits: [vocab]"""
    stream = stream if stream is not None else make_generator(params)
    batch = SamplingBatch.build([SamplingRow(params, stream.seed, stream.draws)], logits.device)
    stream.draws += 1
    row = sample_rows(logits[None], batch)[0]
    if row.problem is not None:
        raise FloatingPointError(row.problem)
    return row.token
