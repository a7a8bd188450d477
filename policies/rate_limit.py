"""Token-bucket rate limits per key; pure bookkeeping, the clock is passed in for testability."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[str, _Bucket] = {}

    def acquire(self, key: str, per_minute: int) -> float:
        """Take one request from key's bucket; returns 0 if allowed, else seconds until one is available."""
        if per_minute <= 0:
            return 0.0
        now = self.clock()
        rate = per_minute / 60.0
        bucket = self.buckets.setdefault(key, _Bucket(float(per_minute), now))
        bucket.tokens = min(float(per_minute), bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / rate
