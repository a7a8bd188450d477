"""How many threads decode on the CPU takes with no prompt in prefill: every thread it has, or half of them where
half measured faster at this batch size, as the steps ran while serving (issue 44).

Every thread is the right count on a quiet box (the 1B ladder model, quiet: 2 threads decoded at 12.3 tok/s against
7.6 at 1). With another process on one of the cores it is the wrong one: ggml's and torch's threads meet at a
barrier after every operation, and each barrier waits for the scheduler to run the thread that lost its core
(measured on the 2-core box at load 11-17: one thread 6x faster than two, for llama-server and for ours alike,
docs/sizes.md). llama-server's setting is chosen by measuring its options before it runs; ours is chosen the same way
but while serving, so it follows the load: each batch size is measured with every thread first, then with half, and
each time is measured again once it is MAX_AGE_S old (StepTimes forgets it), which tries the other count again.
Beside a prompt in prefill the ThreadShare of decode_gpu/core/step_times.py decides; this is only the alone case."""

from __future__ import annotations

import collections

from decode_gpu.core.step_times import MAX_AGE_S, MAX_INTERVAL_S

ALONE_EVERY, ALONE_HALVED = "alone", "alone-halved"  # decode with no prompt in prefill, on every thread or on half
TRIES = 3  # steps of a count at a batch size before its mean is compared: one step after a switch can be an outlier
# a count that lost by a factor r is tried again after max_age_s x r, at most this many times max_age_s: trying two
# threads that measured 6x slower every 30 s cost 3 slow steps in 30 (8B, single stream: 832 ms a token against the
# 600 of its products alone)
MAX_HOLD = 8.0


class AloneThreads:
    def __init__(self, max_age_s: float = MAX_AGE_S, tries: int = TRIES) -> None:
        self.max_age_s, self.tries = max_age_s, tries
        # (mode, size class) -> (when, seconds) of its steps in the last max_age_s
        self.steps: dict[tuple[str, int], collections.deque[tuple[float, float]]] = {}
        # (mode, size class) -> (until when, its mean): the count that lost, not tried again before then
        self.held: dict[tuple[str, int], tuple[float, float]] = {}

    def record(self, mode: str, batch: int, seconds: float, now: float) -> None:
        if mode in (ALONE_EVERY, ALONE_HALVED) and batch > 0 and 0 < seconds < MAX_INTERVAL_S:
            self.steps.setdefault((mode, _size_class(batch)), collections.deque()).append((now, seconds))

    def mode(self, batch: int, now: float) -> str:
        """ALONE_HALVED where half the threads measured faster at this batch's size class (sizes within a power of
        two), or where every thread was measured and half not yet (it is tried), else ALONE_EVERY. The count that
        lost by a factor r is held out for max_age_s x r (at most MAX_HOLD x), its last mean standing for it."""
        every, halved = self._mean(ALONE_EVERY, batch, now), self._mean(ALONE_HALVED, batch, now)
        if every is None:
            return ALONE_EVERY
        if halved is None:
            return ALONE_HALVED
        winner, loser = (ALONE_HALVED, ALONE_EVERY) if halved < every else (ALONE_EVERY, ALONE_HALVED)
        key = (loser, _size_class(batch))
        if key not in self.held or self.held[key][0] <= now:  # measured again just now: hold it out anew
            ratio = max(every, halved) / max(min(every, halved), 1e-9)
            self.held[key] = (now + self.max_age_s * min(ratio, MAX_HOLD), max(every, halved))
        return winner

    def _mean(self, mode: str, batch: int, now: float) -> float | None:
        """The mean step time of `mode` at this size class over the last max_age_s, once it ran `tries` steps."""
        steps = self.steps.get((mode, _size_class(batch)))
        if steps is None:
            return None
        while steps and steps[0][0] < now - self.max_age_s:
            steps.popleft()
        if len(steps) >= self.tries:
            return sum(s for _, s in steps) / len(steps)
        held = self.held.get((mode, _size_class(batch)))
        return held[1] if held is not None and held[0] > now else None


def _size_class(batch: int) -> int:
    """1, 2-3, 4-7, 8-15, ...: a step's time per row changes little within a power of two, and each class is
    measured with both counts (a class per batch size would try the slower count at every size)."""
    return batch.bit_length()
