"""Structured outputs in the decode engine: one llguidance matcher per constrained sequence, advanced with every
token it takes, and one token bitmask per step for the rows that have one.

The prefill worker masked the first token with the same grammar; the matcher here starts by accepting it. The
mask is built on the host (llguidance walks the grammar per row, within its work limits) and applied on the
device by the batched sampler, to the rows that are constrained only: the others' logits are not touched, and
their tokens are what they would be alone. A matcher that errs fails its sequence (GrammarError from bitmask);
it never lets the sequence go on unconstrained.

Compiles run in a bounded pool under a time limit (contracts.grammar_compile.CompilePool). `prepare` starts one from any
thread; `matcher` (on the engine thread) takes a prepared grammar at once, or waits for the compile up to the
limit. Each compiled grammar is kept (COMPILED_GRAMMARS, least recently used dropped) and copied per sequence.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from contracts.grammar import DEFAULT_COMPILE_TIMEOUT_S, GrammarTooComplexError, Matcher, compile_matcher
from contracts.grammar_compile import CompilePool

log = logging.getLogger(__name__)
COMPILED_GRAMMARS = 64  # compiled grammars kept per engine


def llg_tokenizer(tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
    """llguidance's view of a transformers (fast) tokenizer: each token's bytes, which tokens are special, and
    the end-of-sequence tokens that end a complete grammar. About half a second for a 49k vocabulary."""
    from llguidance.hf import from_tokenizer
    return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None)


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, pool: CompilePool | None = None) -> None:
        started = time.perf_counter()
        self._tokenizer = llg_tokenizer(tokenizer, vocab_size, stop_token_ids)
        self._stops = tuple(stop_token_ids)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._pool = pool or CompilePool(workers=1, capacity=4, name="engine-grammar")
        self._lock = threading.Lock()  # prepare may come from another thread than the engine's
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        log.info("structured outputs: llguidance tokenizer for %d tokens in %.2f s", vocab_size,
                 time.perf_counter() - started)

    def prepare(self, kind: str, source: str) -> Future:
        """Start compiling a constraint (any thread); the future's result is a Matcher at the grammar's start.
        GrammarBusyError when the pool is full."""
        key = (kind, source)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:  # compiled, compiling, or failed (a compile error is for good)
                self._compiled.move_to_end(key)
                return future
            future, _started = self._pool.submit(compile_matcher, self._tokenizer, kind, source, self._stops)
            self._compiled[key] = future
            if len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
            return future

    def matcher(self, kind: str, source: str) -> Matcher:
        """A fresh matcher of the constraint; GrammarError if it does not compile within the time limit."""
        future = self.prepare(kind, source)
        try:
            return future.result(self.timeout_s).copy()
        except FutureTimeout:
            raise GrammarTooComplexError(f"compiling the {kind} constraint took longer than the limit of "
                                         f"{self.timeout_s:g} s") from None

    def bitmask(self, matchers: list, device: torch.device) -> tuple[list[int], torch.Tensor]:
        """The rows that have a matcher, and the batch's bitmask [len(matchers), ceil(vocab / 32)] int32 on the
        device, filled on those rows (bit j of word w: token 32w + j may be drawn). GrammarError naming the
        failure when a matcher errs (the engine then samples row by row, and that row's sequence fails)."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        words = (self.vocab_size + 31) // 32
        mask = torch.zeros(len(matchers), words, dtype=torch.int32)  # [n, words]: unfilled rows allow nothing
        row_bytes = words * 4
        for row in rows:
            matchers[row].fill_bitmask(mask.data_ptr() + row * row_bytes, row_bytes)
        return rows, mask.to(device, non_blocking=True)


def apply_mask(scores: torch.Tensor, token_mask: tuple[list[int], torch.Tensor]) -> None:
    """-inf, in place, on what the grammar of each constrained row does not allow; the other rows are not
    touched. Tokens past the mask's vocabulary (a padded lm_head) are never allowed. # scores: [n, vocab]"""
    rows, bitmask = token_mask  # bitmask: [n, words] int32
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=scores.device)  # [m]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    allowed = ((bitmask.index_select(0, index.to(bitmask.device))[:, :, None] >> bits) & 1).bool()  # [m, words, 32]
    allowed = allowed.reshape(len(rows), -1).to(scores.device)  # [m, words * 32]
    vocab = scores.shape[-1]
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    picked = scores.index_select(0, index).masked_fill(~allowed[:, :vocab], float("-inf"))  # [m, vocab]
    scores.index_copy_(0, index, picked)
