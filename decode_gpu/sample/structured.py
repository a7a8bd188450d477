"""Structured outputs in the decode engine: one llguidance matcher per constrained sequence, advanced with every
token it takes, and one token bitmask per step for the rows that have one.

The prefill worker masked the first token with the same grammar; the matcher here starts by accepting it. The
mask is built on the host (llguidance walks the grammar per row, within its work limits) and applied on the
device by the batched sampler (sampling.token_mask.apply_mask), to the rows that are constrained only: the others'
logits are not touched, and their tokens are what they would be alone. A matcher that errs fails its sequence
(GrammarError from bitmask); it never lets the sequence go on unconstrained.

Compiles run in a bounded pool under a time limit (contracts.grammar_compile), the grammar made in a compile process
killed at the limit. `prepare` starts one from any thread;
`matcher` (on the engine thread) takes a prepared grammar at once, or waits for the compile up to the limit. Each
compiled grammar is kept (COMPILED_GRAMMARS, least recently used dropped) by the request's cache salt and its
constraint, so a sequence reuses only its own tenant's compiles, and copied per sequence.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from contracts.compile_processes import CompileProcesses
from contracts.grammar import Matcher
from contracts.grammar_compile import CompiledGrammars, CompilePool, downstream_timeout_s

log = logging.getLogger(__name__)
COMPILED_GRAMMARS = 64  # compiled grammars kept per engine (by cache salt and constraint)


def llg_tokenizer(tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
    """llguidance's view of a transformers (fast) tokenizer: each token's bytes, which tokens are special, and
    the end-of-sequence tokens that end a complete grammar. About half a second for a 49k vocabulary."""
    from llguidance.hf import from_tokenizer
    return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None)


class Grammars:
    """timeout_s: the compile limit, by default the gateway's with the downstream margin (the gateway checked the
    constraint over this model's vocabulary already)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], timeout_s: float | None = None,
                 pool: CompilePool | None = None) -> None:
        started = time.perf_counter()
        self._tokenizer = llg_tokenizer(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.compiled = CompiledGrammars(lambda: self._tokenizer, stop_token_ids, timeout_s or downstream_timeout_s(),
                                         pool or CompilePool(workers=1, capacity=4, name="engine-grammar"),
                                         COMPILED_GRAMMARS, CompileProcesses(workers=1))
        log.info("structured outputs: llguidance tokenizer for %d tokens in %.2f s", vocab_size,
                 time.perf_counter() - started)

    def prepare(self, kind: str, source: str, cache_salt: str = "") -> Future:
        """Start compiling a constraint (any thread, no waiting); the future's result is a Matcher at the
        grammar's start. GrammarBusyError when the pool is full. cache_salt: the request's (KVHandoff.cache_salt):
        only compiles of that salt are reused."""
        return self.compiled.prepare(kind, source, cache_salt)

    def matcher(self, kind: str, source: str, cache_salt: str = "") -> Matcher:
        """A fresh matcher of the constraint, from a compile of its cache salt only; GrammarError if it does not
        compile within the time limit."""
        return self.compiled.matcher(kind, source, cache_salt)

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

