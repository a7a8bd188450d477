"""How large a prefill worker's RAM prompt cache is: `prefix_cache_tokens` bounded by a share of the box's RAM.

The cache's KV cells sit in the worker's llama.cpp context beside the n_ctx cells a prompt needs, allocated (and
zeroed) when the worker starts, so its size is memory held for the worker's life. `prefix_cache_tokens` (default
8192) is the most a worker keeps; it also keeps at most PROMPT_CACHE_RAM_SHARE of the box's RAM in bytes, at
the model's KV bytes a token in the worker's KV type, and never fewer than FLOOR_TOKENS for that (the earlier
default, which every model had). On the embedded model the knob binds (8192 tokens: 180 MiB at f16, of a 384 MiB
share on a 24 GiB box); on an 8B (128 KiB a token at f16) the share does (3072 tokens). The earlier prompts it holds
at most (llama.cpp sequences) follow from the tokens: one per ENTRY_TOKENS, within [MIN_ENTRIES, MAX_ENTRIES].

Pure arithmetic, in contracts because the memory plan (contracts/memory_plan.py) and the worker
(prefill_cpu/worker.py) must agree on it; docs/kv_tiers.md has the why.
"""

from __future__ import annotations

PROMPT_CACHE_RAM_SHARE = 1 / 64  # each worker's prompt cache, at most this share of the box's RAM
FLOOR_TOKENS = 2048  # the byte share never takes a cache below this (prefix_cache_tokens can)
ENTRY_TOKENS = 256  # one earlier prompt kept per this many tokens of cache
MIN_ENTRIES, MAX_ENTRIES = 8, 64  # llama.cpp allows 256 sequences; a lookup scans every entry


def prompt_cache_tokens(configured: int, host_bytes: int, kv_bytes_per_token: int) -> int:
    """The cache's tokens: `configured` (prefix_cache_tokens; 0 = off), at most the RAM share's worth of KV, but
    the share never takes it below FLOOR_TOKENS."""
    if configured <= 0:
        return 0
    if kv_bytes_per_token <= 0:
        raise ValueError(f"KV bytes a token must be positive, got {kv_bytes_per_token}")
    by_bytes = int(host_bytes * PROMPT_CACHE_RAM_SHARE) // kv_bytes_per_token
    return min(configured, max(FLOOR_TOKENS, by_bytes))


def prompt_cache_entries(tokens: int) -> int:
    """Earlier prompts kept at most in a cache of `tokens`: enough that short prompts (a chat's turns) fill the tokens
    before the count, few enough that a lookup's scan of every entry stays short."""
    if tokens <= 0:
        return 0
    return min(MAX_ENTRIES, max(MIN_ENTRIES, tokens // ENTRY_TOKENS))
