"""The engine's generation rate, for stats: smoothed over steps, so one slow or idle step does not swing it; and
moving estimates of step times by a key, for the decisions taken while serving (decode_gpu.runner.weight_switch)."""

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


class StepTimes:
    """Moving estimates of step ms by a key (rows, precision, ...): each new step weighs `weight`, one step's time is
    clamped to 8x the estimate (a stall moves it, but not all the way)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.ms: dict = {}
        self.count: dict = {}

    def record(self, key, ms: float) -> None:
        old = self.ms.get(key)
        self.ms[key] = ms if old is None else old + self.weight * (min(ms, 8 * old) - old)
        self.count[key] = self.count.get(key, 0) + 1

    def get(self, key) -> float | None:
        return self.ms.get(key)

    def describe(self) -> str:
        return ", ".join(f"{key}: {ms:.1f} ({self.count[key]})" for key, ms in sorted(self.ms.items()))
