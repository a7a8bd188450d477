"""How long a decode step takes at each batch size, as measured while serving: what a running sequence waits
between two of its tokens (the forward, sampling, imports, pacing and yields to prefill all included). The
scheduler reads it to keep the batch within the tightest time-per-output-token objective of its sequences."""

from __future__ import annotations

import math

MAX_INTERVAL_S = 60.0  # longer than any step: the engine was idle in between, not stepping
MAX_AGE_S = 30.0  # a size not run for this long is measured again (the load beside decode may have changed)


class StepTimes:
    def __init__(self, smoothing: float = 0.2, max_age_s: float = MAX_AGE_S) -> None:
        self.smoothing, self.max_age_s = smoothing, max_age_s
        self.seconds: dict[int, tuple[float, float]] = {}  # batch size -> (smoothed step time, when last measured)

    def record(self, batch: int, seconds: float, now: float) -> None:
        if batch <= 0 or not 0 < seconds < MAX_INTERVAL_S:
            return
        before = self.seconds.get(batch)
        smoothed = seconds if before is None else before[0] + self.smoothing * (seconds - before[0])
        self.seconds[batch] = (smoothed, now)

    def batch_limit(self, limit_s: float, now: float) -> int:
        """The largest batch whose step stays within limit_s: a larger batch is taken to be no faster than any
        smaller one measured (the envelope), and between a size within the limit and the first past it the time is
        interpolated. While every size measured recently is within it, one past the largest: the batch grows one
        sequence a step, and each new size is measured by running it."""
        for batch in [b for b, (_, when) in self.seconds.items() if now - when > self.max_age_s]:
            del self.seconds[batch]
        within, worst = 0, 0.0
        for batch in sorted(self.seconds):
            slower = max(worst, self.seconds[batch][0])
            if slower > limit_s:
                if within == 0 or slower <= worst:
                    return max(1, within)
                fraction = (limit_s - worst) / (slower - worst)
                return max(1, within + math.floor(fraction * (batch - within)))
            within, worst = batch, slower
        return within + 1
