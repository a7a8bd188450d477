"""Stored Responses conversations (OpenAI Responses' `store` and `previous_response_id`): each stored response's
items (the input it was answered from, then its output) under the API key that made it, so that a later request of
that key may continue it. Bounded: at most max_per_key responses per key and max_total in all, each for ttl_s;
the least recently used goes first. One key never reads another's: the key is part of every lookup."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

MAX_PER_KEY = 256
MAX_TOTAL = 4096
TTL_S = 3600.0


class ResponseStore:
    def __init__(self, max_per_key: int = MAX_PER_KEY, max_total: int = MAX_TOTAL, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_per_key, self.max_total, self.ttl_s, self.clock = max_per_key, max_total, ttl_s, clock
        self.entries: OrderedDict[tuple[str, str], tuple[float, tuple[dict, ...]]] = OrderedDict()  # LRU first
        self.num_per_key: dict[str, int] = {}

    def put(self, owner: str, response_id: str, items: tuple[dict, ...]) -> None:
        """owner: the API key's id ("" without keys)."""
        self.delete(owner, response_id)
        self.entries[(owner, response_id)] = (self.clock() + self.ttl_s, items)
        self.num_per_key[owner] = self.num_per_key.get(owner, 0) + 1
        if self.num_per_key[owner] > self.max_per_key:
            self._drop(next(k for k in self.entries if k[0] == owner))
        while len(self.entries) > self.max_total:
            self._drop(next(iter(self.entries)))

    def get(self, owner: str, response_id: str) -> tuple[dict, ...] | None:
        """The items, or None: unknown, expired, or another key's."""
        entry = self.entries.get((owner, response_id))
        if entry is None:
            return None
        if entry[0] <= self.clock():
            self._drop((owner, response_id))
            return None
        self.entries.move_to_end((owner, response_id))
        return entry[1]

    def delete(self, owner: str, response_id: str) -> bool:
        if (owner, response_id) not in self.entries:
            return False
        self._drop((owner, response_id))
        return True

    def _drop(self, key: tuple[str, str]) -> None:
        del self.entries[key]
        self.num_per_key[key[0]] -= 1
        if not self.num_per_key[key[0]]:
            del self.num_per_key[key[0]]
