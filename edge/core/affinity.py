"""Prefix affinity: which decode engine served a prompt's beginning last, so that the next prompt sharing it goes
there too and finds its KV blocks in that engine's prefix cache (decode_gpu.core.block_manager names full prompt blocks
by a hash chain of their tokens).

The gateway sees a request before it is tokenized, so the key is the prompt's leading text: the first
PREFIX_CHARS characters of the completion prompt, or of the chat messages in order (what the chat template renders
first: the system prompt, then the turns), or the first PREFIX_CHARS // 4 token ids of a tokenized prompt, salted
by the KV type and the request's cache salt (the engine's cache is per KV type and per salt too). PREFIX_CHARS is
about 70 tokens of English, four or five 16-token blocks: two prompts agreeing that far usually share a system
prompt or a conversation, and a prompt shorter than that is keyed by all of it. The map key -> engine is an LRU
of bounded size.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

PREFIX_CHARS = 256
MAX_KEYS = 4096  # ~100 bytes each; an old prefix's blocks are long evicted from the engine's cache anyway


def prefix_key(prompt: str | None, messages: tuple[dict, ...] | None, prompt_tokens: tuple[int, ...] | None,
               salt: str = "") -> bytes:
    if prompt_tokens is not None:
        lead = ",".join(map(str, prompt_tokens[:PREFIX_CHARS // 4]))
    elif messages is not None:
        lead = "".join(f"{m['role']}\0{m['content']}\0" for m in messages)[:PREFIX_CHARS]
    else:
        lead = (prompt or "")[:PREFIX_CHARS]
    return hashlib.blake2b(f"{salt}\1{lead}".encode("utf-8", "surrogatepass"), digest_size=16).digest()


class PrefixAffinity:
    """key -> the engine that last took a prompt with that key, the least recently used forgotten first."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self.engines: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self.engines)

    def get(self, key: bytes | None) -> str | None:
        return self.engines.get(key) if key is not None else None

    def remember(self, key: bytes | None, engine: str) -> None:
        if key is None:
            return
        self.engines[key] = engine
        self.engines.move_to_end(key)
        while len(self.engines) > self.max_keys:
            self.engines.popitem(last=False)
