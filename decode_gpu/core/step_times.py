"""How long a decode step takes at each batch size, as measured while serving: what a running sequence waits
between two of its tokens (the forward, sampling, imports, pacing and yields to prefill all included). The
scheduler reads it to keep the batch within the tightest time-per-output-token objective of its sequences; the
model runner, decoding on the CPU beside llama.cpp prefill, reads the times of its two thread counts
(`ThreadShare`) to keep every thread while the halved step would break that objective."""

from __future__ import annotations

import collections
import math

MAX_INTERVAL_S = 60.0  # longer than any step: the engine was idle in between, not stepping
MAX_AGE_S = 30.0  # a size not run for this long is measured again (the load beside decode may have changed)
SHAPE_CLIP = 2.0  # StepTimes.shape: a step counts for at most this many times the size's current time
MIN_RECENT_STEPS = 8  # steps of a batch size in the last MAX_AGE_S before recent_ms reports its mean


class StepTimes:
    def __init__(self, smoothing: float = 0.2, max_age_s: float = MAX_AGE_S) -> None:
        self.smoothing, self.max_age_s = smoothing, max_age_s
        self.seconds: dict[int, tuple[float, float]] = {}  # batch size -> (smoothed step time, when last measured)
        # batch size -> (when, seconds) of its steps in the last max_age_s, and their sum: recent_ms's means, read
        # with the engine's stats after every step, so kept as running sums rather than summed again each time
        self.steps: dict[int, collections.deque[tuple[float, float]]] = {}
        self._sums: dict[int, float] = {}
        # batch size -> smoothed step time, never forgotten: the curve's shape (how the step grows with the batch),
        # which fair_share reads for a request's share of a step; the load scales every size alike, the shape stays
        self.shape: dict[int, float] = {}

    def record(self, batch: int, seconds: float, now: float, for_shape: bool = True) -> None:
        """A step of `batch` sequences took `seconds`; for_shape False: it ran beside something else (a prompt in
        prefill), so it counts for the times a sequence sees, not for the curve's shape."""
        if batch <= 0 or not 0 < seconds < MAX_INTERVAL_S:
            return
        self.steps.setdefault(batch, collections.deque()).append((now, seconds))
        self._sums[batch] = self._sums.get(batch, 0.0) + seconds
        self._forget_steps(batch, now)
        before = self.seconds.get(batch)
        if before is not None and now - before[1] > self.max_age_s:
            before = None  # measured again: an old time is of another load, not a sample to smooth with
        smoothed = seconds if before is None else before[0] + self.smoothing * (seconds - before[0])
        self.seconds[batch] = (smoothed, now)
        if not for_shape:
            return
        shape = self.shape.get(batch)
        # a step past twice the curve waited (for a more important prefill, a peer's, the gate): it moves the curve by
        # at most what twice would, so a load that really doubled is learned over a few steps, one wait is not
        self.shape[batch] = seconds if shape is None else \
            shape + self.smoothing * (min(seconds, SHAPE_CLIP * shape) - shape)

    def rows_within(self, base: int, factor: float) -> int | None:
        """The largest batch whose step costs at most `factor` times a step of `base` rows, read off the measured
        curve's shape: piecewise linear between the sizes measured, a larger batch taken to be no faster than a
        smaller one (the envelope), a size below the smallest measured at that one's time. Not a line through every
        size: on a CPU the weights change form with the batch (decode_gpu.model.weight_quant: int4 up to a few rows,
        bfloat16 above), so the step jumps there, and a line over 1 and 32 rows put a plain request beside an n = 32
        one at 10 rows, 4x its own step, not 2x. While every size measured past `base` is within, one past the largest
        (the batch grows a row a step, and each new size is measured by running it). None while fewer than two sizes
        were measured or the step does not grow with the batch (a GPU's, nearly): no bound."""
        if len(self.shape) < 2:
            return None
        curve, worst = [], 0.0
        for size in sorted(self.shape):
            worst = max(worst, self.shape[size])
            curve.append((size, worst))
        if curve[-1][1] <= curve[0][1]:
            return None
        limit = factor * _interpolate(curve, base)
        within, before = base, (base, _interpolate(curve, base))
        for size, seconds in curve:
            if size <= base:
                continue
            if seconds > limit:
                (a, at) = before
                return max(within, a + math.floor((limit - at) / (seconds - at) * (size - a)))
            within, before = size, (size, seconds)
        return within + 1

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

    def recent_ms(self, now: float) -> dict[int, float]:
        """The mean milliseconds of each batch size's steps in the last max_age_s, for sizes stepped at least
        MIN_RECENT_STEPS times there: what a sequence decoding at that size gets a token over that time, its steps
        beside a prefill (on halved threads) and between prefills alike. The smoothed times above follow the last
        few steps, which beside one long prompt's prefill are slower than any answer's mean (the gateway's TPOT check
        read them at first and refused at half the box's capacity)."""
        out = {}
        for batch in sorted(self.steps):
            steps = self._forget_steps(batch, now)
            if len(steps) >= MIN_RECENT_STEPS:
                out[batch] = round(self._sums[batch] / len(steps) * 1e3, 2)
        return out

    def _forget_steps(self, batch: int, now: float) -> collections.deque[tuple[float, float]]:
        """Drop this size's steps older than max_age_s (the oldest first) from its window and sum."""
        steps = self.steps[batch]
        while steps and steps[0][0] < now - self.max_age_s:
            self._sums[batch] -= steps.popleft()[1]
        if not steps:
            self._sums[batch] = 0.0  # no rounding left over from the steps subtracted
        return steps

    def estimate(self, batch: int, now: float) -> float | None:
        """The step time of this batch size: measured, else no less than the slowest smaller size measured (the
        envelope); None when nothing at or below it was measured recently."""
        known = [seconds for size, (seconds, when) in self.seconds.items()
                 if size <= batch and now - when <= self.max_age_s]
        return max(known) if known else None


def _interpolate(curve: list[tuple[int, float]], size: int) -> float:
    """The step time at `size` on a measured curve of (batch, seconds) in batch order: linear between the two
    measured sizes around it, the nearest measured one's outside them (below the smallest, or past the largest)."""
    if size <= curve[0][0]:
        return curve[0][1]
    for (a, at), (b, bt) in zip(curve, curve[1:]):
        if size <= b:
            return at + (bt - at) * (size - a) / (b - a)
    return curve[-1][1]


# decode beside prefill on half its threads or on all of them; with no prompt in prefill, on all of them
HALVED, EVERY, ALONE = "halved", "every", "alone"


class ThreadShare:
    """Decode on the CPU beside prefill halves its threads (contracts/cpu_share.py), unless a sequence in the batch
    has a TPOT objective that the step on halved threads, as measured at this batch size, would break: then decode
    keeps every thread, as long as that was not measured slower still (two thread pools on two cores can be). Sizes
    not measured are tried: halved first, then every thread; each is measured again once MAX_AGE_S old, so the
    choice follows the load beside decode. Priority-only batches (no TPOT objective) always halve, as before."""

    def __init__(self, max_age_s: float = MAX_AGE_S) -> None:
        self.times = {HALVED: StepTimes(max_age_s=max_age_s), EVERY: StepTimes(max_age_s=max_age_s)}

    def record(self, mode: str, batch: int, seconds: float, now: float) -> None:
        if mode in self.times:
            self.times[mode].record(batch, seconds, now)

    def keep_threads(self, batch: int, tpot_s: float, now: float) -> bool:
        """Whether a step of `batch` sequences, the tightest TPOT objective among them tpot_s (0: none), should
        keep every thread while prompts prefill."""
        if not tpot_s:
            return False
        halved = self.times[HALVED].estimate(batch, now)
        if halved is None or halved <= tpot_s:
            return False
        every = self.times[EVERY].estimate(batch, now)
        return every is None or every < halved
