"""Which degradation tier is in force, from a stream of load signals, with hysteresis and dwell.

Tiers are ordered by severity. The evaluator escalates at once to the heaviest tier whose enter
condition holds (any signal at or above its threshold; `slo_attainment_below`, attainment of the objectives,
below it). It steps down one tier only when the current
tier's exit condition holds (every exit signal below its threshold) and it has been in force for at
least its min_dwell_s; so a signal hovering around one threshold cannot make it flap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from policies.schema import BELOW_SIGNALS, Tier

log = logging.getLogger("policies.evaluator")


@dataclass(frozen=True)
class TierState:
    index: int  # -1: normal operation; else the index of the tier in force
    name: str  # "normal" or the tier's name
    reason: str  # the signals that put or kept it there
    since: float  # clock time it entered this tier


@dataclass(frozen=True)
class Transition:
    before: str
    after: str
    reason: str
    signals: dict


NORMAL = "normal"


class TierEvaluator:
    def __init__(self, tiers: tuple[Tier, ...], now: float = 0.0, model: str = "") -> None:
        self.tiers = tiers
        self.model = model  # "": the box's (or the one model's); else the model whose load it follows
        self.state = TierState(-1, NORMAL, "no tier condition holds", now)
        self.transitions: list[Transition] = []

    def update(self, signals: dict[str, float], now: float) -> Transition | None:
        """Feed the latest signals; returns the transition if the tier changed (logged once)."""
        target = self._heaviest_entered(signals)
        current = self.state.index
        if target is not None and target > current:
            return self._move(target, _entered_because(self.tiers[target], signals), signals, now)
        if current >= 0 and self._may_leave(signals, now):
            tier = self.tiers[current]
            return self._move(current - 1, f"{tier.name} exit holds: {_exit_because(tier, signals)}", signals, now)
        return None

    def _heaviest_entered(self, signals: dict[str, float]) -> int | None:
        for index in range(len(self.tiers) - 1, -1, -1):
            if _enter_holds(self.tiers[index], signals):
                return index
        return None

    def _may_leave(self, signals: dict[str, float], now: float) -> bool:
        tier = self.tiers[self.state.index]
        return now - self.state.since >= tier.min_dwell_s and _exit_holds(tier, signals)

    def _move(self, index: int, reason: str, signals: dict, now: float) -> Transition:
        before = self.state.name
        name = NORMAL if index < 0 else self.tiers[index].name
        self.state = TierState(index, name, reason, now)
        transition = Transition(before, name, reason, dict(signals))
        self.transitions.append(transition)
        log.warning("degradation tier%s %s -> %s: %s (signals: %s)", f" of {self.model}" if self.model else "",
                    before, name, reason,
                    ", ".join(f"{k}={v:.3g}" for k, v in sorted(signals.items())))
        return transition

    @property
    def tier(self) -> Tier | None:
        return self.tiers[self.state.index] if self.state.index >= 0 else None


def _entered(name: str, threshold: float, signals: dict[str, float]) -> bool:
    """A signal at or above its threshold; a BELOW signal (SLO attainment) below it, and only once measured."""
    if name in BELOW_SIGNALS:
        return name in signals and signals[name] < threshold
    return signals.get(name, 0.0) >= threshold


def _left(name: str, threshold: float, signals: dict[str, float]) -> bool:
    if name in BELOW_SIGNALS:
        return signals.get(name, 1.0) >= threshold  # not measured (no recent judged request): nothing is missed
    return signals.get(name, 0.0) < threshold


def _enter_holds(tier: Tier, signals: dict[str, float]) -> bool:
    return any(_entered(name, threshold, signals) for name, threshold in tier.enter.items())


def _exit_holds(tier: Tier, signals: dict[str, float]) -> bool:
    return all(_left(name, threshold, signals) for name, threshold in tier.exit.items())


def _entered_because(tier: Tier, signals: dict[str, float]) -> str:
    hits = [f"{n}={signals.get(n, 0.0):.3g} {'<' if n in BELOW_SIGNALS else '>='} {t:g}"
            for n, t in tier.enter.items() if _entered(n, t, signals)]
    return f"{tier.name} enter holds: " + ", ".join(hits)


def _exit_because(tier: Tier, signals: dict[str, float]) -> str:
    return ", ".join(f"{n}={signals.get(n, 1.0 if n in BELOW_SIGNALS else 0.0):.3g} "
                     f"{'>=' if n in BELOW_SIGNALS else '<'} {t:g}" for n, t in tier.exit.items())


class ModelTiers:
    """The tier evaluators of a server: the box's (key "": with one model, that model's load; with several, the most
    loaded model's, which the status page shows) and, once `per_model` is set (several models, issue 45), one per
    model fed that model's own load, whose tier is the one its requests get: a busy model degrades its own requests,
    not the others'."""

    def __init__(self, tiers: tuple[Tier, ...], now: float) -> None:
        self.per_model = False
        self.evaluators: dict[str, TierEvaluator] = {"": TierEvaluator(tiers, now)}

    @property
    def box(self) -> TierEvaluator:
        return self.evaluators[""]

    def of(self, model: str, now: float) -> TierEvaluator:
        """The evaluator for a request for `model`: the model's own (normal until its load is first measured) when
        tiers are per model, else the box's."""
        if not self.per_model or not model:
            return self.box
        evaluator = self.evaluators.get(model)
        if evaluator is None:
            evaluator = self.evaluators[model] = TierEvaluator(self.box.tiers, now, model)
        return evaluator

    def update(self, signals: dict[str, float], model: str, now: float) -> Transition | None:
        target = self.box if not model else self.of(model, now) if self.per_model else None
        return target.update(signals, now) if target is not None else None

    def keep(self, models: set[str]) -> None:
        """Forget the evaluators of models no longer loaded (a model loaded again starts in normal operation)."""
        for model in [m for m in self.evaluators if m and m not in models]:
            del self.evaluators[model]

    def reinstall(self, tiers: tuple[Tier, ...], now: float) -> None:
        """A new policy's tiers (hot reload): each evaluator keeps the tier in force when the new policy still has
        one of that name, and its transitions."""
        for model, old in list(self.evaluators.items()):
            evaluator = TierEvaluator(tiers, now, model)
            for index, tier in enumerate(tiers):
                if tier.name == old.state.name:
                    evaluator.state = TierState(index, tier.name, "kept across a policy reload", old.state.since)
            evaluator.transitions = old.transitions
            self.evaluators[model] = evaluator
