"""Table-driven tests of the tier evaluator over synthetic signal traces."""

import pytest

from policies.evaluator import TierEvaluator
from policies.schema import Tier

TIERS = (
    Tier("busy", enter={"kv_cache_usage": 0.7, "waiting_requests": 10}, exit={"kv_cache_usage": 0.5,
                                                                              "waiting_requests": 5}, min_dwell_s=10),
    Tier("overloaded", enter={"kv_cache_usage": 0.9}, exit={"kv_cache_usage": 0.8}, min_dwell_s=5),
)

# each trace: (time, signals, tier expected after the update)
TRACES = {
    "stays normal below thresholds": [
        (0, {"kv_cache_usage": 0.2}, "normal"), (1, {"kv_cache_usage": 0.69, "waiting_requests": 9}, "normal")],
    "enters on any one signal": [
        (0, {"kv_cache_usage": 0.1, "waiting_requests": 10}, "busy")],
    "holds inside the hysteresis band": [
        (0, {"kv_cache_usage": 0.75}, "busy"), (20, {"kv_cache_usage": 0.6}, "busy"),
        (40, {"kv_cache_usage": 0.69}, "busy")],
    "holds until the dwell has passed": [
        (0, {"kv_cache_usage": 0.75}, "busy"), (3, {"kv_cache_usage": 0.1}, "busy"),
        (9.9, {"kv_cache_usage": 0.1}, "busy"), (10, {"kv_cache_usage": 0.1}, "normal")],
    "leaves only when every exit signal is below": [
        (0, {"kv_cache_usage": 0.8}, "busy"), (20, {"kv_cache_usage": 0.1, "waiting_requests": 6}, "busy"),
        (21, {"kv_cache_usage": 0.1, "waiting_requests": 4}, "normal")],
    "escalates straight to the heaviest tier": [
        (0, {"kv_cache_usage": 0.95}, "overloaded")],
    "escalates from busy at once, without dwell": [
        (0, {"kv_cache_usage": 0.75}, "busy"), (1, {"kv_cache_usage": 0.92}, "overloaded")],
    "steps down one tier at a time": [
        (0, {"kv_cache_usage": 0.95}, "overloaded"), (6, {"kv_cache_usage": 0.1}, "busy"),
        (7, {"kv_cache_usage": 0.1}, "busy"), (16, {"kv_cache_usage": 0.1}, "normal")],
    "a flapping signal does not flap the tier": [
        (t, {"kv_cache_usage": 0.71 if t % 2 else 0.69}, "busy") for t in range(1, 9)],
    "re-entering after leaving": [
        (0, {"kv_cache_usage": 0.75}, "busy"), (10, {"kv_cache_usage": 0.2}, "normal"),
        (11, {"kv_cache_usage": 0.7}, "busy")],
}


@pytest.mark.parametrize("trace", TRACES.values(), ids=TRACES.keys())
def test_trace(trace):
    evaluator = TierEvaluator(TIERS, now=0)
    for now, signals, expected in trace:
        evaluator.update(signals, now)
        assert evaluator.state.name == expected, (now, signals)


def test_transitions_are_reported_once_with_their_signals():
    evaluator = TierEvaluator(TIERS, now=0)
    first = evaluator.update({"kv_cache_usage": 0.75}, 0)
    assert first.before == "normal" and first.after == "busy" and "kv_cache_usage=0.75 >= 0.7" in first.reason
    assert first.signals == {"kv_cache_usage": 0.75}
    assert evaluator.update({"kv_cache_usage": 0.76}, 1) is None  # staying is not a transition
    assert len(evaluator.transitions) == 1
