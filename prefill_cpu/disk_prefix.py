"""Between a Prefiller's llama.cpp context and its prompt cache's disk tier (prefill_cpu.kv_disk_tier).

The tier holds llama.cpp's own sequence state bytes (llama_state_seq_get_data, what the handoff parses); a stored
prefix comes back with llama_state_seq_set_data into the prompt's sequence, is cut to the tokens it shares with the
prompt, and the prompt prefills only the rest. An exact repeat with its stored last logits computes nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import numpy as np

from contracts.cache import cache_root
from prefill_cpu.kv_disk_entry import EntryFacts
from prefill_cpu.kv_disk_tier import KVDiskTier, kv_disk_folder

log = logging.getLogger(__name__)
# a stored prefix is read, checked and restored only when it covers this many more tokens than the RAM cache's
# (a 1,500-token entry of the embedded model is about 18 MB to read and hash: worth some 30 tokens of prefill)
MIN_GAIN_TOKENS = 32


def open_disk_tier(prefiller, flash_attn: bool) -> KVDiskTier | None:
    """The Prefiller's disk tier, when its config asks for one (kv_disk_bytes) and its model can use one."""
    config, ident = prefiller.config, prefiller.identity
    if config.kv_disk_bytes <= 0:
        return None
    if ident.swa_layers:
        log.info("KV disk tier off: a sliding-window cache cannot restore an earlier prompt's prefix")
        return None
    weights = "given" if prefiller.weights_path == ident.path else os.path.basename(prefiller.weights_path)
    facts = EntryFacts(ident.fingerprint, weights, llama_cpp.__version__, config.kv_type, prefiller.k_rotation,
                       prefiller.v_rotation, flash_attn, ident.n_layer, ident.n_embd_k, ident.n_embd_v,
                       prefiller.vocab_size)
    root = Path(config.kv_disk_dir) if config.kv_disk_dir else cache_root() / "kv"
    folder = kv_disk_folder(root, ident.fingerprint, config.kv_type, config.worker_name)
    try:
        return KVDiskTier(folder, config.kv_disk_bytes, facts)
    except OSError as err:  # the worker serves without it rather than not at all
        log.error("KV disk tier off: cannot use %s: %s", folder, err)
        return None


def seq_state_bytes(ctx, seq_id: int) -> bytes:
    """llama_state_seq_get_data's bytes of one sequence."""
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id)
    if written != size:
        raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return bytes(buf)


def restore_prefix(ctx, tier: KVDiskTier, tokens: list[int], salt: str, seq_id: int, ram_shared: int,
                   make_room: Callable[[], None]) -> tuple[int, np.ndarray | None] | None:
    """Restore into seq_id (empty) the stored prefix of this salt sharing the most tokens with the prompt, when it
    beats the RAM cache's ram_shared: (prompt tokens it covers, the last logits when that is all of them), or None.
    make_room: frees the RAM cache's cells, asked once when the context has no room for the entry."""
    candidate = tier.find(tokens, salt)
    if candidate is None or candidate.shared < ram_shared + MIN_GAIN_TOKENS:
        if ram_shared == 0:
            tier.count_miss()
        return None
    entry = tier.load(candidate, tokens, salt)
    if entry is None:
        return None
    memory = llama_cpp.llama_get_memory(ctx)
    if not set_seq_state(ctx, entry.state, seq_id):
        make_room()
        if not set_seq_state(ctx, entry.state, seq_id):
            log.warning("KV disk tier: no room in the context for a %d-token entry", entry.header.n_tokens)
            llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
            return None
    # the entry's logits are those of this very prompt: every cell restored, nothing computed (an answer's entry
    # carries its prompt's logits: logits_len)
    whole = candidate.shared == len(tokens) == entry.header.logits_follow and entry.last_logits is not None
    cached = len(tokens) if whole else min(candidate.shared, len(tokens) - 1)
    llama_cpp.llama_memory_seq_rm(memory, seq_id, cached, -1)  # the entry's tokens past the shared prefix
    return cached, entry.last_logits if whole else None


def set_seq_state(ctx, state: memoryview, seq_id: int) -> bool:
    """llama_state_seq_set_data into seq_id (which llama.cpp empties first); False when the context has no room."""
    buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
    return llama_cpp.llama_state_seq_set_data(ctx, buf, len(state), seq_id) == len(state)


def describe_tiers(prefiller) -> str:
    """One log line of the prompt cache's tiers: RAM (llama.cpp cells) and disk."""
    ram = prefiller.cache
    line = (f"prompt cache RAM: {ram.num_hits} hits, {ram.num_misses} misses, {len(ram.entries)} entries, "
            f"{ram.num_tokens} tokens, {ram.num_evictions} evictions")
    if prefiller.disk is not None:
        s = prefiller.disk.stats()
        line += (f"; disk: {s.hits} hits ({s.hit_tokens} tokens), {s.misses} misses, {s.entries} entries, "
                 f"{s.bytes / 2**20:.1f} of {s.max_bytes / 2**20:.0f} MiB, {s.written} written, {s.evictions} "
                 f"evictions, {s.rejected} rejected, {s.dropped_writes} dropped and "
                 f"{s.skipped_writes} skipped writes")
    return line
