"""The weight plan's batch-size switch, following step times measured while serving.

weight_dtype auto on a CPU may hold two copies of the layers' weights: quantized ones, which win at small batches,
and float ones (bfloat16, oneDNN's layout), which win at larger ones; QuantizedLinear picks by its `float_above`, the
largest batch that uses the quantized weights, which the switch sets before every step to give that step the
precision it chose. The start-up measurement gives a cut-off from a few milliseconds of one pass over the layers
(weight_plan.py), on a machine that may have been busy just then; every batch size starts from it. Here each size
moves on its own with the real steps: each step's time is kept as a moving estimate by (rows, precision, mode); now
and then (every `explore_every` steps at a size and mode) a step runs on the other precision, so both estimates stay
current; when the other one is faster by more than `hysteresis`, over at least `min_samples` steps of each, that
size in that mode moves to it. Every move is logged. An explored step is only timed: the model runner runs it again
on the plan's weights for its tokens (one extra forward in explore_every), so the exploration never changes an
answer; only a move of the plan does.

`mode` is the decode's share of the cores for the step (the model runner's thread mode: alone, every thread beside a
prefill, or halved beside one; "" where decode does not share the CPU): a step beside a llama.cpp prefill runs on
fewer threads, or slower, and which precision wins differs. One cut-off over every size and mode flapped: in a
bench.slo_bench run it moved 53 times in 18 minutes, between 0 and 4 and back within a second, because the steps
served did not order as a cut-off can (here float won at 1 row, int4 at 2-4 rows, bfloat16 above), and steps beside
prefills met steps alone in one estimate.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from decode_gpu.core.throughput import StepTimes

log = logging.getLogger(__name__)


class WeightSwitch:
    def __init__(self, layers: Iterable, float_above: int, max_rows: int, explore_every: int = 50,
                 hysteresis: float = 0.1, min_samples: int = 3) -> None:
        """layers: the model's QuantizedLinear layers holding float weights too; float_above: the start-up plan's
        cut-off, where every (size, mode) starts."""
        self.layers = list(layers)
        self.float_above = float_above
        self.choices: dict[tuple[int, str], str] = {}  # (rows, mode) -> precision, once its steps moved it
        self.max_rows = max_rows
        self.explore_every = explore_every
        self.hysteresis = hysteresis
        self.min_samples = min_samples
        self.times = StepTimes()
        self._steps: dict[tuple[int, str], int] = {}  # steps seen by (row count, mode)
        self._forced: str | None = None  # the precision this step was forced to (exploring), if any
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
        self._forced = None
        if n % self.explore_every == 0:
            precision = self._forced = _other(precision)
        self._hold(rows, precision)
        return precision

    def after_step(self, rows: int, precision: str, ms: float) -> None:
        """Record a step's time, put the layers back on the plan, and move this size in this mode to the other
        precision if that has been faster by more than the hysteresis."""
        mode = self._mode
        self.times.record((rows, precision, mode), ms)
        planned = self.planned(rows)
        if self._forced is not None:
            self._forced = None
            self._hold(rows, planned)
        quantized, floats = self.times.get((rows, "quantized", mode)), self.times.get((rows, "float", mode))
        if quantized is None or floats is None or min(self.times.count[rows, "quantized", mode],
                                                      self.times.count[rows, "float", mode]) < self.min_samples:
            return
        mine, other = (quantized, floats) if planned == "quantized" else (floats, quantized)
        if other < (1 - self.hysteresis) * mine:
            moved = self.choices[rows, mode] = _other(planned)
            log.info("weight plan%s: %d rows %s -> %s (quantized %.1f ms, float %.1f ms, moving estimates of the "
                     "steps served)", f" ({mode})" if mode else "", rows, planned, moved, quantized, floats)
            self._hold(rows, moved)

    def moved(self) -> dict[str, str]:
        """The sizes whose precision differs from the start-up cut-off's, "rows/mode" -> precision."""
        start = {True: "quantized", False: "float"}
        return {"/".join(map(str, filter(None, key))): precision for key, precision in sorted(self.choices.items())
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


def _other(precision: str) -> str:
    return "float" if precision == "quantized" else "quantized"
