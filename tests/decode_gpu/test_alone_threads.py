"""Decode with no prompt in prefill keeps every thread unless half measured faster at the batch's size class:
each count is tried `tries` steps, the faster mean wins, and the loser is tried again after max_age_s times the
factor it lost by (the load beside the engine changes; a count far slower is not retried often)."""

import types

import pytest

from decode_gpu.runner.alone_threads import ALONE_EVERY, ALONE_HALVED, AloneThreads


def run(chooser, batch, now, step_s):
    """One step chosen at `now`, recorded with the time its count takes: returns the mode and the next `now`."""
    mode = chooser.mode(batch, now)
    seconds = step_s[mode]
    chooser.record(mode, batch, seconds, now + seconds)
    return mode, now + seconds


def test_every_thread_is_kept_where_it_is_faster_after_half_was_tried():
    chooser, now, modes = AloneThreads(max_age_s=30, tries=3), 0.0, []
    for _ in range(10):
        mode, now = run(chooser, 4, now, {ALONE_EVERY: 0.1, ALONE_HALVED: 0.15})
        modes.append(mode)
    assert modes == [ALONE_EVERY] * 3 + [ALONE_HALVED] * 3 + [ALONE_EVERY] * 4


def test_half_the_threads_win_on_a_loaded_box_and_every_thread_is_tried_again_after_a_hold_as_long_as_it_lost_by():
    chooser, now, steps = AloneThreads(max_age_s=5, tries=2), 0.0, []
    for _ in range(400):  # every thread 0.6 s a step (another process holds a core), half 0.1 s: 6x
        started = now
        mode, now = run(chooser, 8, now, {ALONE_EVERY: 0.6, ALONE_HALVED: 0.1})
        steps.append((started, mode))
    assert [m for _, m in steps[:4]] == [ALONE_EVERY, ALONE_EVERY, ALONE_HALVED, ALONE_HALVED]
    decided = steps[4][0]  # every thread lost 6x: held out for 6 x 5 s, not tried each time its steps age (5 s)
    retried = [t for t, m in steps[4:] if m == ALONE_EVERY]
    assert retried and decided + 30 <= retried[0] <= decided + 31
    assert len(retried) == 2 and steps[-1][1] == ALONE_HALVED  # tried `tries` steps, lost again, held again


def test_size_classes_are_measured_apart_and_other_modes_are_ignored():
    chooser = AloneThreads(max_age_s=30, tries=1)
    chooser.record(ALONE_EVERY, 1, 0.5, 1.0)
    chooser.record(ALONE_HALVED, 1, 0.1, 1.0)
    chooser.record("halved", 16, 0.01, 1.0)  # a step beside prefill: ThreadShare's, not ours
    chooser.record(ALONE_EVERY, 16, 120.0, 1.0)  # the engine idled between two steps: not a step's time
    assert chooser.mode(1, 2.0) == ALONE_HALVED
    assert chooser.mode(16, 2.0) == ALONE_EVERY  # nothing measured at 16-31 yet
    chooser.record(ALONE_EVERY, 17, 0.2, 2.0)
    assert chooser.mode(31, 2.5) == ALONE_HALVED  # same class as 17: every thread measured, half tried next


class Gate:
    prefill_active, held_for, enabled = False, None, True


def test_the_runner_halves_its_threads_with_no_prompt_in_prefill_where_half_measured_faster():
    torch = pytest.importorskip("torch")
    from decode_gpu.core.step_times import ThreadShare
    from decode_gpu.runner.model_runner import ModelRunner
    runner = object.__new__(ModelRunner)
    clock = types.SimpleNamespace(t=0.0)
    runner.gate, runner.clock, runner._threads = Gate(), lambda: clock.t, (2, 1)
    runner.thread_share, runner.alone_threads, runner._last_forward = ThreadShare(), AloneThreads(tries=2), None
    seqs = [types.SimpleNamespace(seq_id=f"s{i}", priority=0, tpot_slo_ms=0) for i in range(3)]
    before = torch.get_num_threads()
    try:
        used = []
        for _ in range(7):
            runner._set_threads(seqs)
            used.append(torch.get_num_threads())
            clock.t += 0.9 if used[-1] == 2 else 0.2  # two threads lose a core to another process
        assert used == [2, 2, 1, 1, 1, 1, 1]  # two steps on every thread (timed at the next one), then half wins
    finally:
        torch.set_num_threads(before)
