"""A grammar's token bitmask applied to a batch's scores: the structured-output mask of both the prefill worker's
first token and the decode engine's later ones (the matchers that fill it live with each process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from contracts.grammar import Matcher  # llguidance's wrapper: loaded only by those that have a grammar

WORD_BITS = 32  # tokens per int32 word of a bitmask (llguidance's layout)


def matcher_bitmask(matcher: Matcher, vocab: int) -> torch.Tensor:
    """One matcher's allowed tokens at its current state, on the host. # [1, ceil(vocab / 32)] int32
    GrammarError if the matcher errs (the request fails rather than go on unconstrained)."""
    mask = torch.zeros(1, (vocab + WORD_BITS - 1) // WORD_BITS, dtype=torch.int32)  # [1, words]
    matcher.fill_bitmask(mask.data_ptr(), mask.numel() * mask.element_size())
    return mask


def apply_mask(scores: torch.Tensor, token_mask: tuple[list[int], torch.Tensor]) -> None:
    """-inf, in place, on what the grammar of each constrained row does not allow; the other rows are not
    touched. Tokens past the mask's vocabulary (a padded lm_head) are never allowed. # scores: [n, vocab]"""
    rows, bitmask = token_mask  # bitmask: [n, words] int32
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=scores.device)  # [m]
    bits = torch.arange(WORD_BITS, dtype=torch.int32, device=bitmask.device)  # [32]
    allowed = ((bitmask.index_select(0, index.to(bitmask.device))[:, :, None] >> bits) & 1).bool()  # [m, words, 32]
    allowed = allowed.reshape(len(rows), -1).to(scores.device)  # [m, words * 32]
    vocab = scores.shape[-1]
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    picked = scores.index_select(0, index).masked_fill(~allowed[:, :vocab], float("-inf"))  # [m, vocab]
    scores.index_copy_(0, index, picked)
