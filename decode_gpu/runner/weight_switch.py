"""The weight plan's batch-size switch, following step times measured while serving.

weight_dtype auto on a CPU may hold two copies of the layers' weights: quantized ones, which win at small batches,
and float ones (bfloat16, oneDNN's layout), which win at larger ones; QuantizedLinear picks by `float_above`, the
largest batch that uses the quantized weights. The start-up measurement sets it from a few milliseconds of one
pass over the layers (weight_plan.py), on a machine that may have been busy just then. Here it moves with the real
steps: each step's time is kept as a moving estimate by (rows, precision, mode); now and then (every
`explore_every` steps at a batch size) a step runs on the other precision, so both estimates stay current; when the
other one is faster by more than `hysteresis` at a batch size, over at least `min_samples` steps of each, float_above
moves past it. Every move is logged. An explored step is only timed: the model runner runs it again on the plan's
weights for its tokens (one extra forward in explore_every), so the exploration never changes an answer; only a move
of the plan does.

`mode` is the decode's share of the cores for the step (the model runner's thread mode: alone, every thread beside a
prefill, or halved beside one; "" where decode does not share the CPU). Each mode has its own estimates and its own
float_above: a step beside a llama.cpp prefill runs on fewer threads, or slower, and which precision wins differs.
One cut-off over every mode compared steps taken under different conditions: in a bench.slo_bench run it moved 53
times in 18 minutes, between 0 and 4 and back within a second, as 1-row steps beside prefills (mostly quantized)
met 1-row steps alone (mostly float).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from decode_gpu.core.throughput import StepTimes

log = logging.getLogger(__name__)


class WeightSwitch:
    def __init__(self, layers: Iterable, float_above: int, max_rows: int, explore_every: int = 50,
                 hysteresis: float = 0.1, min_samples: int = 3) -> None:
        """layers: the model's QuantizedLinear layers holding float weights too; float_above: the start-up plan's,
        every mode's until its own steps move it."""
        self.layers = list(layers)
        self.start_plan = float_above
        self.plans: dict[str, int] = {}  # mode -> float_above, once its steps moved it
        self.max_rows = max_rows
        self.explore_every = explore_every
        self.hysteresis = hysteresis
        self.min_samples = min_samples
        self.times = StepTimes()
        self._steps: dict[tuple[int, str], int] = {}  # steps seen by (row count, mode)
        self._forced: str | None = None  # the precision this step was forced to (exploring), if any
        self._mode = ""  # the mode of the step under way (the last one's after it)

    @property
    def float_above(self) -> int:
        """The cut-off of the mode of the step under way, or of the last one."""
        return self.plan(self._mode)

    def plan(self, mode: str) -> int:
        return self.plans.get(mode, self.start_plan)

    def planned(self, rows: int) -> str:
        return "quantized" if rows <= self.float_above else "float"

    def before_step(self, rows: int, mode: str = "") -> str:
        """The precision this step of `rows` rows in `mode` uses (every explore_every-th step at that size and mode:
        the other one); the layers are set to it."""
        self._mode = mode
        n = self._steps[rows, mode] = self._steps.get((rows, mode), 0) + 1
        precision = self.planned(rows)
        self._forced = None
        if n % self.explore_every == 0:
            precision = self._forced = "float" if precision == "quantized" else "quantized"
            self._apply(rows - 1 if precision == "float" else rows)
        else:
            self._apply(self.float_above)
        return precision

    def after_step(self, rows: int, precision: str, ms: float) -> None:
        """Record a step's time, put the layers back on the plan, and move the step's mode's plan if the other
        precision has been faster at this size, in this mode, by more than the hysteresis."""
        mode = self._mode
        self.times.record((rows, precision, mode), ms)
        if self._forced is not None:
            self._forced = None
            self._apply(self.float_above)
        quantized, floats = self.times.get((rows, "quantized", mode)), self.times.get((rows, "float", mode))
        if quantized is None or floats is None or min(self.times.count[rows, "quantized", mode],
                                                      self.times.count[rows, "float", mode]) < self.min_samples:
            return
        moved, plan = None, self.float_above
        if rows <= plan and floats < (1 - self.hysteresis) * quantized:
            moved = rows - 1  # float from this size on
        elif rows > plan and quantized < (1 - self.hysteresis) * floats:
            moved = rows  # quantized up to this size
        if moved is not None:
            log.info("weight plan%s: float_above %d -> %d (at %d rows: quantized %.1f ms, float %.1f ms, moving "
                     "estimates of the steps served)", f" ({mode})" if mode else "", plan, moved, rows, quantized,
                     floats)
            self.plans[mode] = moved
            self._apply(moved)

    def describe(self) -> str:
        plans = ", ".join(f"{mode}: {above}" for mode, above in sorted(self.plans.items()))
        return f"quantized up to batch {self.float_above}, float above" + (f" (by mode: {plans})" if plans else "") + \
            "; step ms by (rows, precision, mode): " + self.times.describe()

    def _apply(self, float_above: int) -> None:
        if self.layers and self.layers[0].float_above != float_above:
            for layer in self.layers:
                layer.float_above = float_above
