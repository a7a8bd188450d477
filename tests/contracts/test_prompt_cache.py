"""The RAM prompt cache's size (contracts.prompt_cache): prefix_cache_tokens within a share of the box's RAM, and
the worker resolving it from its model's KV bytes a token (prefill_cpu.worker.worker_cache_tokens)."""

from __future__ import annotations

import pytest

from contracts.model_sizes import model_sizes
from contracts.options import KNOBS
from contracts.process_config import WorkerProcessConfig
from contracts.prompt_cache import (
    FLOOR_TOKENS,
    MAX_ENTRIES,
    MIN_ENTRIES,
    PROMPT_CACHE_RAM_SHARE,
    prompt_cache_entries,
    prompt_cache_tokens,
)
from prefill_cpu.worker import worker_cache_tokens

GIB, KIB = 2**30, 2**10


def test_the_knob_binds_where_the_ram_share_holds_more():
    # the embedded model at f16 (22.5 KiB a token) on a 24 GiB box: the 384 MiB share holds 17476 tokens
    assert prompt_cache_tokens(8192, 24 * GIB, 23040) == 8192
    assert prompt_cache_tokens(1000, 24 * GIB, 23040) == 1000  # a smaller setting is kept as set


def test_the_ram_share_binds_a_large_model_but_never_below_the_floor():
    # an 8B at f16 (128 KiB a token): 384 MiB of 24 GiB is 3072 tokens
    assert prompt_cache_tokens(8192, 24 * GIB, 128 * KIB) == 3072
    tokens = prompt_cache_tokens(8192, 24 * GIB, 128 * KIB)
    assert tokens * 128 * KIB <= 24 * GIB * PROMPT_CACHE_RAM_SHARE
    # on 4 GiB the share would be 512 tokens: the floor (the old default) holds
    assert prompt_cache_tokens(8192, 4 * GIB, 128 * KIB) == FLOOR_TOKENS
    assert prompt_cache_tokens(1024, 4 * GIB, 128 * KIB) == 1024  # the floor never raises a setting


def test_zero_is_off_and_a_bad_kv_size_is_refused():
    assert prompt_cache_tokens(0, 24 * GIB, 23040) == 0
    assert prompt_cache_entries(0) == 0
    with pytest.raises(ValueError, match="KV bytes a token"):
        prompt_cache_tokens(8192, 24 * GIB, 0)


def test_entries_follow_the_tokens_within_bounds():
    assert prompt_cache_entries(512) == MIN_ENTRIES
    assert prompt_cache_entries(2048) == 8
    assert prompt_cache_entries(8192) == 32  # 8 conversations of 6 turns fit with room (bench/kv_return_bench.py)
    assert prompt_cache_entries(1 << 20) == MAX_ENTRIES


def test_the_default_holds_eight_growing_chats_in_one_worker():
    """The multi-turn bench's load (8 conversations growing to about 270 tokens, kept as one entry each) fits the
    default cache of one worker without an eviction, with the embedded model's KV at f16 on a 24 GiB box."""
    default = KNOBS["prefix_cache_tokens"].default
    tokens = prompt_cache_tokens(default, 24 * GIB, 23040)
    assert tokens >= 8 * 300 and prompt_cache_entries(tokens) >= 8


def test_the_worker_sizes_its_cache_from_its_model_and_the_ram(tiny_gguf):
    path = str(tiny_gguf("llama"))
    per_token = model_sizes(path).handoff_kv_bytes("f16")
    config = WorkerProcessConfig(model=path, listen="unix:/unused", kv_type="f16", prefix_cache_tokens=8192)
    assert worker_cache_tokens(config, host_bytes=64 * GIB) == 8192
    # a RAM whose share holds 3000 tokens of this model's KV
    small = int(3000 * per_token / PROMPT_CACHE_RAM_SHARE)
    assert worker_cache_tokens(config, host_bytes=small) == 3000
    assert worker_cache_tokens(WorkerProcessConfig(model=path, listen="unix:/unused", kv_type="f16",
                                                   prefix_cache_tokens=0), host_bytes=small) == 0
