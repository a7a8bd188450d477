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
        bucket = self._refilled(key, per_minute)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) * 60.0 / per_minute

    def wait(self, key: str, per_minute: int) -> float:
        """What acquire would answer, without taking anything: 0 if a request may go now."""
        if per_minute <= 0:
            return 0.0
        bucket = self._refilled(key, per_minute)
        return 0.0 if bucket.tokens >= 1.0 else (1.0 - bucket.tokens) * 60.0 / per_minute

    def _refilled(self, key: str, per_minute: int) -> _Bucket:
        now = self.clock()
        bucket = self.buckets.setdefault(key, _Bucket(float(per_minute), now))
        bucket.tokens = min(float(per_minute), bucket.tokens + (now - bucket.updated) * per_minute / 60.0)
        bucket.updated = now
        return bucket
