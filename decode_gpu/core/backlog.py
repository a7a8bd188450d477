"""The engine's handoff backlog: KV bytes of handoffs accepted but not yet imported into the pool.

Handoffs wait in the server's inbox and the scheduler's waiting heap holding their whole KV payload, so
that memory is bounded here, in bytes. The asyncio side reserves when a handoff arrives (and refuses it
when the backlog is full); the engine thread releases once the KV is in the pool or the request ended
first. It is the one piece of engine bookkeeping both threads touch, so it carries its own lock; only one
thread reserves, so `can_reserve` then `reserve` cannot race (a release only makes room).
"""

from __future__ import annotations

import threading

DEFAULT_LIMIT_BYTES = 512 << 20
FULL = "engine backlog is full"  # how a refused handoff's error begins (the gateway answers 503 on it)


class Backlog:
    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"the backlog limit must be positive, got {limit_bytes} bytes")
        self.limit_bytes = limit_bytes
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def can_reserve(self, n_bytes: int) -> bool:
        """An empty backlog takes any one handoff (the frame cap bounds it), so a long prompt whose KV alone
        exceeds the limit still runs, alone."""
        used = self._num_bytes
        return used == 0 or used + n_bytes <= self.limit_bytes

    def reserve(self, n_bytes: int) -> None:
        with self._lock:
            self._num_bytes += n_bytes

    def release(self, n_bytes: int) -> None:
        with self._lock:
            self._num_bytes -= n_bytes

    def full_message(self, n_bytes: int) -> str:
        return (f"{FULL}: {_size(self._num_bytes)} of handoffs wait for KV memory, this one adds {_size(n_bytes)}, "
                f"the limit is {_size(self.limit_bytes)} (--max-backlog-bytes); retry later")


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes} bytes"
