"""Per-key token quotas: prompt + completion tokens per UTC day and per UTC calendar month, counted from the
requests that ended. A request in flight holds what it may still use (its prompt's estimate and n x max_tokens)
from admission to its end, so concurrent requests and many choices cannot overrun a quota. The counts live in
memory and, when given a path, in a small JSON state file rewritten after each counted request, so a restart of
the service keeps the day's and the month's usage."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

STATE_VERSION = 1


def key_id(api_key: str | None) -> str | None:
    """An API key's short hash, as logs, the gateway's observers and the state file name it."""
    return None if api_key is None else "sha256:" + hashlib.sha256(api_key.encode("utf-8", "replace")).hexdigest()[:16]


@dataclass
class Usage:
    day: str  # the UTC day counted, "2025-01-31"
    month: str  # the UTC month counted, "2025-01"
    day_tokens: int = 0
    month_tokens: int = 0


@dataclass(frozen=True)
class QuotaExceeded:  # a quota's state: exceeded once used >= limit
    quota: str  # "tokens_per_day" or "tokens_per_month"
    used: int
    limit: int
    resets_at: datetime  # UTC
    retry_after_s: int  # whole seconds until resets_at, at least 1


class TokenQuotas:
    def __init__(self, state_path: str = "", clock=time.time) -> None:
        self.state_path = state_path  # "": counts in memory only
        self.clock = clock  # wall clock (epoch seconds): the periods are calendar days and months
        self.usage: dict[str, Usage] = {}  # key hash -> its counts
        self.held: dict[str, int] = {}  # key hash -> tokens its requests in flight may still use (not saved)
        if state_path:
            self._load()

    def current(self, key: str) -> Usage:
        """key's counts for today and this month (a count of a past period reads as 0)."""
        now = self._now()
        day, month = f"{now:%Y-%m-%d}", f"{now:%Y-%m}"
        usage = self.usage.get(key)
        if usage is None or usage.month != month:
            return Usage(day, month)
        return usage if usage.day == day else Usage(day, month, 0, usage.month_tokens)

    def add(self, key: str, tokens: int) -> None:
        usage = self.current(key)
        usage.day_tokens += tokens
        usage.month_tokens += tokens
        self.usage[key] = usage
        if self.state_path:
            self.save()

    def hold(self, key: str, tokens: int) -> None:
        self.held[key] = self.held.get(key, 0) + tokens

    def unhold(self, key: str, tokens: int) -> None:
        left = self.held.get(key, 0) - tokens
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)

    def exceeded(self, key: str, per_day: int, per_month: int) -> QuotaExceeded | None:
        """The quota key has used up, counting what its requests in flight hold (0: unlimited), or None. The
        month is checked first: when both are used up, its reset is the later one, the one worth waiting for."""
        return next((q for q in self.quotas(key, per_day, per_month) if q.used >= q.limit), None)

    def tightest(self, key: str, per_day: int, per_month: int) -> QuotaExceeded | None:
        """The quota with the fewest tokens left, None without quotas."""
        return min(self.quotas(key, per_day, per_month), key=lambda q: q.limit - q.used, default=None)

    def quotas(self, key: str, per_day: int, per_month: int) -> list[QuotaExceeded]:
        """The state of each of key's quotas (0: none), month first; used counts what its requests hold."""
        usage, now, held = self.current(key), self._now(), self.held.get(key, 0)
        found = []
        if per_month:
            reset = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
            found.append(QuotaExceeded("tokens_per_month", usage.month_tokens + held, per_month, reset,
                                       _seconds(now, reset)))
        if per_day:
            reset = datetime.fromordinal(now.toordinal() + 1).replace(tzinfo=UTC)
            found.append(QuotaExceeded("tokens_per_day", usage.day_tokens + held, per_day, reset,
                                       _seconds(now, reset)))
        return found

    def save(self) -> None:
        """Write the counts to the state file: a temporary file renamed over it, so a crash mid-write leaves
        the previous counts, never half a file. No fsync: a power loss may cost the last counts."""
        text = json.dumps({"version": STATE_VERSION, "keys": {key: asdict(u) for key, u in self.usage.items()}})
        temporary = self.state_path + ".tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(temporary, self.state_path)

    def _load(self) -> None:
        try:
            with open(self.state_path) as fh:
                data = json.load(fh)
            if data.get("version") != STATE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, this build reads {STATE_VERSION}")
            usage = {key: Usage(**counts) for key, counts in data["keys"].items()}
        except FileNotFoundError:
            return
        except OSError as err:
            raise ValueError(f"quota state file {self.state_path}: cannot read it: {err.strerror}") from None
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise ValueError(f"quota state file {self.state_path} is not a valid state file ({err}); remove it "
                             f"to start every key's token counts again from zero") from None
        month = f"{self._now():%Y-%m}"
        self.usage = {key: u for key, u in usage.items() if u.month == month}  # past months count for nothing

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)


def _seconds(now: datetime, then: datetime) -> int:
    return max(1, math.ceil((then - now).total_seconds()))
