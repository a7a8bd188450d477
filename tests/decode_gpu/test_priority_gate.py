"""PriorityGate: decode waits only while a strictly more important prompt is in prefill, and never too long."""

import threading
import time

from decode_gpu.core.priority_gate import PriorityGate

# "did not wait": far under any hold these tests set (a gate that waits, waits 0.2 s or more), with room for a thread
# descheduled on a machine busy with other work
NO_WAIT_S = 0.1


def waited(gate: PriorityGate, batch_priority: int, release_after_s: float | None = None, then=None) -> float:
    if release_after_s is not None:
        threading.Timer(release_after_s, gate.hold, args=(then,)).start()
    started = time.monotonic()
    gate.wait_turn(batch_priority)
    return time.monotonic() - started


def test_no_hold_or_a_less_important_hold_does_not_wait():
    gate = PriorityGate(enabled=True)
    assert waited(gate, 10) < NO_WAIT_S
    gate.hold(10)
    assert waited(gate, 10) < NO_WAIT_S  # equal priority: prefill and decode share
    assert waited(gate, 0) < NO_WAIT_S
    assert gate.waited_s < 3 * NO_WAIT_S


def test_a_more_important_prefill_holds_decode_until_it_ends():
    gate = PriorityGate(enabled=True, max_hold_s=30.0)  # the release ends the wait, not the bound (30 s)
    gate.hold(0)
    assert 0.15 < waited(gate, 10, release_after_s=0.2, then=10) < 10.0
    gate.hold(0)
    assert 0.15 < waited(gate, 10, release_after_s=0.2, then=None) < 10.0
    assert gate.waited_s > 0.3


def test_a_hold_never_lasts_longer_than_its_bound():
    gate = PriorityGate(enabled=True, max_hold_s=0.3)
    gate.hold(0)
    assert 0.2 < waited(gate, 10) < 5.0
    assert waited(gate, 10) < NO_WAIT_S  # the same hold, already past its bound: decode goes on


def test_a_disabled_gate_never_waits():
    gate = PriorityGate(enabled=False)
    gate.hold(0)
    assert waited(gate, 10) < NO_WAIT_S
