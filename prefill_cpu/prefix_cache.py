"""Bookkeeping of the prefill worker's prompt cache: which llama.cpp sequence holds which earlier prompt.

After a prompt is prefilled (or preempted part way), its KV stays in the context under a cache sequence
id. The next prompt that starts with the same tokens (a shared system prompt, a chat's earlier turns, a
preempted prompt coming back) copies that prefix's cells (llama.cpp shares them, nothing is recomputed)
and prefills only the rest. Only prompts of one cache salt share (PrefillJob.cache_salt, one per API key
by default): a prompt never reuses, and so can never time, another tenant's cells. This class only decides;
the Prefiller moves the cells. The token budget
counts each entry whole, so cells two entries share are counted twice: conservative, never over.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass
class CachedPrompt:
    seq_id: int  # the llama.cpp sequence holding this prompt's cells
    tokens: tuple[int, ...]
    last_used: int
    salt: str = ""  # the request's cache salt: only prompts of the same salt reuse these cells
    # the last prompt token's logits when the whole prompt was computed ([vocab] float32): the same prompt again
    # takes them with every cell and computes nothing, so it gets the bits the first computation gave
    last_logits: Any = None
    # how many of `tokens` the last_logits follow (None: all): an answer's KV kept after its prompt (keep_returned)
    # extends the prompt's entry and carries its logits, so the same prompt again still computes nothing
    logits_len: int | None = None


class PrefixCache:
    def __init__(self, seq_ids: list[int], max_tokens: int) -> None:
        self.free_ids = list(seq_ids)
        self.max_tokens = max_tokens
        self.entries: dict[int, CachedPrompt] = {}
        self._clock = itertools.count()
        self.num_hits = self.num_misses = self.num_evictions = 0  # prompts that reused cells or not; entries dropped

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 and bool(self.free_ids or self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries.values())

    def match(self, tokens: tuple[int, ...] | list[int], salt: str = "") -> tuple[int | None, int]:
        """The entry of this salt sharing the longest prefix with tokens: (its seq id, the shared length), or
        (None, 0)."""
        best_id, best_len = None, 0
        for entry in self.entries.values():
            if entry.salt != salt:
                continue
            n = _common_prefix(entry.tokens, tokens)
            if n > best_len:
                best_id, best_len = entry.seq_id, n
        if best_id is not None:
            self.entries[best_id].last_used = next(self._clock)
        return best_id, best_len

    def repeat(self, tokens: tuple[int, ...] | list[int], salt: str = "") -> CachedPrompt | None:
        """The entry of this salt holding exactly these tokens with their last logits, or None."""
        tokens = tuple(tokens)
        for entry in self.entries.values():
            n = len(entry.tokens) if entry.logits_len is None else entry.logits_len
            if entry.salt == salt and entry.last_logits is not None and n == len(tokens) \
                    and entry.tokens[:n] == tokens:
                entry.last_used = next(self._clock)
                return entry
        return None

    def place(self, tokens: tuple[int, ...], salt: str = "",
              last_logits: Any = None) -> tuple[int | None, list[int]]:
        """Where to keep this prompt: (seq id to store it under, or None if it does not fit, seq ids whose
        cells must be removed first). An entry this prompt extends (or repeats) is replaced; otherwise the least
        recently used entries go until the budget holds. last_logits: the last token's, for a whole prompt."""
        if not self.enabled or not tokens or len(tokens) > self.max_tokens:
            return None, []
        extended = [e for e in self.entries.values() if e.salt == salt and tokens[:len(e.tokens)] == e.tokens]
        logits_len = None
        if last_logits is None:  # keep the logits of the longest whole prompt this one extends
            with_logits = [e for e in extended if e.last_logits is not None]
            if with_logits:
                carried = max(with_logits, key=lambda e: len(e.tokens) if e.logits_len is None else e.logits_len)
                last_logits = carried.last_logits
                logits_len = len(carried.tokens) if carried.logits_len is None else carried.logits_len
        evicted = [e.seq_id for e in extended]
        for seq_id in evicted:
            self._drop(seq_id)
        while self.entries and (not self.free_ids or self.num_tokens + len(tokens) > self.max_tokens):
            oldest = min(self.entries.values(), key=lambda e: e.last_used).seq_id
            self._drop(oldest)
            evicted.append(oldest)
            self.num_evictions += 1
        seq_id = self.free_ids.pop()
        self.entries[seq_id] = CachedPrompt(seq_id, tuple(tokens), next(self._clock), salt, last_logits, logits_len)
        return seq_id, evicted

    def clear(self, salt: str | None = None) -> list[int]:
        """Forget every entry (of this salt, given one); returns their seq ids (whose cells the caller removes)."""
        ids = [seq_id for seq_id, e in self.entries.items() if salt is None or e.salt == salt]
        for seq_id in ids:
            self._drop(seq_id)
        self.num_evictions += len(ids)
        return ids

    def count(self, hit: bool) -> None:
        """One prompt looked up: it reused cells of this cache, or not."""
        if hit:
            self.num_hits += 1
        else:
            self.num_misses += 1

    def _drop(self, seq_id: int) -> None:
        del self.entries[seq_id]
        self.free_ids.append(seq_id)


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
