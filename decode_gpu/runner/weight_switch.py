"""The weight plan's batch-size switch, following step times measured while serving.

weight_dtype auto on a CPU may hold two copies of the layers' weights: quantized ones, which win at small batches,
and float ones (bfloat16, oneDNN's layout), which win at larger ones; QuantizedLinear picks by `float_above`, the
largest batch that uses the quantized weights. The start-up measurement sets it from a few milliseconds of one
pass over the layers (weight_plan.py), on a machine that may have been busy just then. Here it moves with the real
steps: each step's time is kept as a moving estimate by (rows, precision); now and then (every `explore_every` steps
at a batch size) a step runs on the other precision, so both estimates stay current; when the other one is faster
by more than `hysteresis` at a batch size, float_above moves past it. Every move is logged. An explored step is only
timed: the model runner runs it again on the plan's weights for its tokens (one extra forward in explore_every), so
the exploration never changes an answer; only a move of the plan does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from decode_gpu.core.throughput import StepTimes

log = logging.getLogger(__name__)


class WeightSwitch:
    def __init__(self, layers: Iterable, float_above: int, max_rows: int, explore_every: int = 50,
                 hysteresis: float = 0.1) -> None:
        """layers: the model's QuantizedLinear layers holding float weights too; float_above: the start-up plan's."""
        self.layers = list(layers)
        self.float_above = float_above
        self.max_rows = max_rows
        self.explore_every = explore_every
        self.hysteresis = hysteresis
        self.times = StepTimes()
        self._steps: dict[int, int] = {}  # steps seen by row count
        self._forced: str | None = None  # the precision this step was forced to (exploring), if any

    def planned(self, rows: int) -> str:
        return "quantized" if rows <= self.float_above else "float"

    def before_step(self, rows: int) -> str:
        """The precision this step of `rows` rows uses (every explore_every-th step at that size: the other one)."""
        n = self._steps[rows] = self._steps.get(rows, 0) + 1
        precision = self.planned(rows)
        self._forced = None
        if n % self.explore_every == 0:
            precision = self._forced = "float" if precision == "quantized" else "quantized"
            self._apply(rows - 1 if precision == "float" else rows)
        return precision

    def after_step(self, rows: int, precision: str, ms: float) -> None:
        """Record a step's time, put the layers back on the plan, and move the plan if the other precision has been
        faster at this size by more than the hysteresis."""
        self.times.record((rows, precision), ms)
        if self._forced is not None:
            self._forced = None
            self._apply(self.float_above)
        quantized, floats = self.times.get((rows, "quantized")), self.times.get((rows, "float"))
        if quantized is None or floats is None:
            return
        moved = None
        if rows <= self.float_above and floats < (1 - self.hysteresis) * quantized:
            moved = rows - 1  # float from this size on
        elif rows > self.float_above and quantized < (1 - self.hysteresis) * floats:
            moved = rows  # quantized up to this size
        if moved is not None:
            log.info("weight plan: float_above %d -> %d (at %d rows: quantized %.1f ms, float %.1f ms, moving "
                     "estimates of the steps served)", self.float_above, moved, rows, quantized, floats)
            self.float_above = moved
            self._apply(moved)

    def describe(self) -> str:
        return f"quantized up to batch {self.float_above}, float above; step ms by (rows, precision): " + \
            self.times.describe()

    def _apply(self, float_above: int) -> None:
        if self.layers and self.layers[0].float_above != float_above:
            for layer in self.layers:
                layer.float_above = float_above
