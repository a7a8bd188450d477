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


def test_a_peer_waits_for_its_own_priority_s_prompts_until_the_release():
    """Half a level below its priority (Sequence.decode_priority): a request with a TTFT objective and none per token
    yields to the prompts of its own priority; the next level's prompts do not hold it."""
    gate = PriorityGate(enabled=True, max_hold_s=30.0)
    gate.hold(0)
    assert 0.15 < waited(gate, 0.5, release_after_s=0.2, then=None) < 10.0
    gate.hold(1)
    assert waited(gate, 0.5) < NO_WAIT_S  # a less important prompt: no hold


def test_peer_holds_are_bounded_in_duty_not_restarted_by_each_new_prompt():
    gate = PriorityGate(enabled=True, max_hold_s=0.3)
    gate.hold(0)
    assert 0.2 < waited(gate, 0.5) < 5.0  # the window's bound
    gate.hold(None)
    gate.hold(0)  # a new prompt of the same level: a strict hold would start over, a peer one does not
    assert waited(gate, 0.5) < NO_WAIT_S
    assert not gate.outranks(0.5)
    time.sleep(0.35)  # the window of twice the bound has passed: peers may yield again
    assert gate.outranks(0.5)
    gate.hold(None)
    gate.hold(0)
    assert gate.outranks(10)  # a strict hold: from its own start
