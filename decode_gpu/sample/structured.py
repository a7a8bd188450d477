"""Structured outputs in the decode engine: one xgrammar matcher per constrained sequence, advanced with every
token it takes, and one token bitmask per step for the rows that have one.

The prefill worker masked the first token with the same grammar; the matcher here starts by accepting it. The
mask is built on the host (xgrammar walks the grammar per row) and applied on the device by the batched
sampler, to the rows that are constrained only: the others' logits are not touched, and their tokens are
what they would be alone.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from contracts.grammar import build_grammar

log = logging.getLogger(__name__)


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr
        started = time.perf_counter()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        log.info("structured outputs: tokenizer info for %d tokens in %.2f s", vocab_size,
                 time.perf_counter() - started)

    def matcher(self, kind: str, source: str):
        """A fresh matcher of the constraint (compiled once per (kind, source)); GrammarError if it does not
        compile."""
        return self._xgr.GrammarMatcher(self._compiled(kind, source))

    @functools.lru_cache(maxsize=64)
    def _compiled(self, kind: str, source: str):
        return self._compiler.compile_grammar(build_grammar(kind, source))

    def bitmask(self, matchers: list, device: torch.device) -> tuple[list[int], torch.Tensor]:
        """The rows that have a matcher, and the batch's xgrammar bitmask [len(matchers), ceil(vocab / 32)] int32
        on the device, filled on those rows (bit j of word w: token 32w + j may be drawn)."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        mask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row in rows:
            matchers[row].fill_next_token_bitmask(mask, row)
        return rows, mask.to(device, non_blocking=True)


def apply_mask(scores: torch.Tensor, token_mask: tuple[list[int], torch.Tensor]) -> None:
    """-inf, in place, on what the grammar of each constrained row does not allow; the other rows are not
    touched (xgrammar's kernel, on the CPU or the GPU). # scores: [n, vocab]"""
    import xgrammar as xgr
    rows, bitmask = token_mask
    xgr.apply_token_bitmask_inplace(scores, bitmask, indices=rows)
