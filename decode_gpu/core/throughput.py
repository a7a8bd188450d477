"""The engine's generation rate, for stats: smoothed over steps, so one slow or idle step does not swing it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Throughput:
    tokens_per_s: float = 0.0
    last_step_ms: float = 0.0
    generated: int = 0

    def record(self, n_tokens: int, seconds: float) -> None:
        self.generated += n_tokens
        self.last_step_ms = seconds * 1e3
        rate = n_tokens / seconds if seconds > 0 else 0.0
        self.tokens_per_s = rate if self.tokens_per_s == 0 else 0.8 * self.tokens_per_s + 0.2 * rate
