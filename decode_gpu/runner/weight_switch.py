"""The weight plan's batch-size switch, following step times measured while serving.

weight_dtype auto on a CPU may hold two copies of the layers' weights: quantized ones, which win at small batches,
and float ones (bfloat16, oneDNN's layout), which win at larger ones; QuantizedLinear picks by its `float_above`, the
largest batch that uses the quantized weights, which the switch sets before every step to give that step the
precision it chose. The start-up measurement gives a cut-off from a few milliseconds of one pass over the layers
(weight_plan.py), on a machine that may have been busy just then; every batch size starts from it. Here each size
moves on its own with the real steps, in pairs: every `explore_every`-th step at a size and mode runs on the other
precision, and then again on the plan's (its tokens come from that run, so exploring never changes an answer); the
ratio of the two times, taken on the same batch a few milliseconds apart, is kept as a moving estimate by (rows,
mode). When it says the other precision is faster by more than `hysteresis`, over at least `min_samples` pairs, that
size in that mode moves to it (logged), and its pairs start afresh. Each step's time is also kept by (rows,
precision, mode) for /health and the logs; those estimates decide nothing.

`mode` is the decode's share of the cores for the step (the model runner's thread mode: alone, every thread beside a
prefill, or halved beside one; "" where decode does not share the CPU). Until 2026-12-05 one cut-off over every size
and mode moved when the explored precision's moving estimate beat the plan's: in a bench.slo_bench run it moved 52
times in one server's 5.5 minutes, between 0 and 4 and back within a second. The steps served did not order as a
cut-off can, and each estimate mixed steps beside a long prefill, a short one or none: an explored precision's
estimate, one step in 50, was minutes older than the plan's. With a choice per size and mode but the same estimates
it still moved 17 times in about 5.5 minutes; from pairs (the conditions the same for both), 0 times in each of two
such runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from decode_gpu.core.throughput import StepTimes

log = logging.getLogger(__name__)


class WeightSwitch:
    def __init__(self, layers: Iterable, float_above: int, max_rows: int, explore_every: int = 50,
                 hysteresis: float = 0.1, min_samples: int = 3, weight: float = 0.3) -> None:
        """layers: the model's QuantizedLinear layers holding float weights too; float_above: the start-up plan's
        cut-off, where every (size, mode) starts; weight: of a new pair in the moving ratio."""
        self.layers = list(layers)
        self.float_above = float_above
        self.choices: dict[tuple[int, str], str] = {}  # (rows, mode) -> precision, once its pairs moved it
        self.max_rows = max_rows
        self.explore_every = explore_every
        self.hysteresis = hysteresis
        self.min_samples = min_samples
        self.weight = weight
        self.times = StepTimes()  # step ms by (rows, precision, mode): reported, not decided on
        self.ratios: dict[tuple[int, str], tuple[float, int]] = {}  # (rows, mode) -> (other / plan ms, pairs)
        self._steps: dict[tuple[int, str], int] = {}  # steps seen by (row count, mode)
        self._mode = ""  # the mode of the step under way (the last one's after it)

    def planned(self, rows: int, mode: str | None = None) -> str:
        """The precision the plan gives `rows` rows in `mode` (default: the mode of the step under way or last)."""
        mode = self._mode if mode is None else mode
        return self.choices.get((rows, mode)) or ("quantized" if rows <= self.float_above else "float")

    def before_step(self, rows: int, mode: str = "") -> str:
        """The precision this step of `rows` rows in `mode` uses (every explore_every-th step at that size and mode:
        the other one); the layers are set to it."""
        self._mode = mode
        n = self._steps[rows, mode] = self._steps.get((rows, mode), 0) + 1
        precision = self.planned(rows)
        if n % self.explore_every == 0:
            precision = _other(precision)
        self._hold(rows, precision)
        return precision

    def after_step(self, rows: int, precision: str, ms: float) -> None:
        """Record a step's time on the plan."""
        self.times.record((rows, precision, self._mode), ms)

    def back_to_plan(self, rows: int) -> None:
        """After an explored step: set the layers to the plan, for its run again."""
        self._hold(rows, self.planned(rows))

    def compared(self, rows: int, explored: str, explored_ms: float, plan_ms: float) -> None:
        """An explored step and its run again on the plan, on the same batch: move this size in this mode to the
        explored precision when the pairs say it is faster by more than the hysteresis."""
        mode = self._mode
        planned = self.planned(rows)
        self.times.record((rows, explored, mode), explored_ms)
        self.times.record((rows, planned, mode), plan_ms)
        ratio = explored_ms / max(plan_ms, 1e-6)
        old, pairs = self.ratios.get((rows, mode), (ratio, 0))
        ratio = old + self.weight * (min(ratio, 4 * old) - old) if pairs else ratio  # a stall moves it 4x at most
        self.ratios[rows, mode] = (ratio, pairs + 1)
        if pairs + 1 >= self.min_samples and ratio < 1 - self.hysteresis:
            self.choices[rows, mode] = explored
            self.ratios.pop((rows, mode))  # the plan changed: the pairs start afresh
            log.info("weight plan%s: %d rows %s -> %s (%s %.2fx the time of %s over %d pairs; last pair %.1f against "
                     "%.1f ms)", f" ({mode})" if mode else "", rows, planned, explored, explored, ratio, planned,
                     pairs + 1, explored_ms, plan_ms)
            self._hold(rows, explored)

    def moved(self) -> dict[str, str]:
        """The sizes whose precision differs from the start-up cut-off's, "rows/mode" -> precision."""
        start = {True: "quantized", False: "float"}
        return {key_name(key): precision for key, precision in sorted(self.choices.items())
                if precision != start[key[0] <= self.float_above]}

    def describe(self) -> str:
        moved = ", ".join(f"{key}: {precision}" for key, precision in self.moved().items())
        return f"quantized up to batch {self.float_above}, float above" + (f" (moved: {moved})" if moved else "") + \
            "; step ms by (rows, precision, mode): " + self.times.describe()

    def _hold(self, rows: int, precision: str) -> None:
        """Set the layers so a step of `rows` rows uses `precision`."""
        float_above = rows - 1 if precision == "float" else rows
        if self.layers and self.layers[0].float_above != float_above:
            for layer in self.layers:
                layer.float_above = float_above


def key_name(key: tuple) -> str:
    """"rows/precision/mode" or "rows/mode" for /health; no mode where decode does not share the CPU."""
    return "/".join(map(str, filter(None, key)))


def _other(precision: str) -> str:
    return "float" if precision == "quantized" else "quantized"
