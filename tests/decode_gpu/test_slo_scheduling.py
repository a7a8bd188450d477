"""Deadlines and TPOT objectives in the decode scheduler: earliest deadline first within a priority, priorities
between levels as before, and a batch that stops taking sequences without an objective where the measured step time
would break the tightest running TPOT objective (a sequence with an objective of its own always joins)."""

import dataclasses
import types

import pytest

from decode_gpu.core.step_times import EVERY, HALVED, MIN_RECENT_STEPS, StepTimes, ThreadShare
from fake_runner import fake_handoff, make_engine


def handoff(request_id, priority=0, deadline=0.0, tpot_slo_ms=0, max_tokens=4):
    return dataclasses.replace(fake_handoff(request_id, [len(request_id), 9, 9], max_tokens, priority),
                               deadline=deadline, tpot_slo_ms=tpot_slo_ms)


def drain(engine):
    while engine.has_work:
        engine.step()


def test_earliest_deadline_first_within_a_priority_and_priority_between_levels():
    engine, runner = make_engine(max_num_seqs=1)
    arrivals = [("late", 0, 300.0), ("none-a", 0, 0.0), ("soon", 0, 100.0), ("bg-urgent", 5, 1.0),
                ("none-b", 0, 0.0), ("mid", 0, 200.0), ("vip", -1, 0.0)]
    for rid, priority, deadline in arrivals:
        engine.add(handoff(rid, priority, deadline))
    drain(engine)
    # vip outranks every deadline; within priority 0 the deadlines, then those without one in arrival order;
    # priority 5 comes last however early its deadline
    assert runner.decoded_order == ["vip", "soon", "mid", "late", "none-a", "none-b", "bg-urgent"]


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def run_with_step_cost(engine, per_sequence_s):
    """Step the engine with a fake clock: each step takes per_sequence_s per sequence it decodes. Returns the
    batch size of each step."""
    clock = Clock()
    engine.scheduler.clock = clock
    sizes = []
    while engine.has_work:
        engine.step()
        sizes.append(engine.scheduler.num_running)
        clock.t += per_sequence_s * engine.scheduler.num_running
    return sizes


def test_a_request_with_a_tpot_objective_of_its_own_always_joins():
    """Its first token went out with its handoff: held back, its own time per token would grow by the wait."""
    engine, _ = make_engine(max_num_seqs=8)
    for i in range(8):
        engine.add(handoff(f"int{i}", tpot_slo_ms=150, max_tokens=30))
    sizes = run_with_step_cost(engine, 0.04)  # 40 ms a sequence: 4 would already take 160 ms
    assert sizes[0] == 8


def test_without_a_tpot_objective_the_batch_fills_at_once():
    engine, _ = make_engine(max_num_seqs=8)
    for i in range(8):
        engine.add(handoff(f"b{i}", max_tokens=30))
    assert max(run_with_step_cost(engine, 0.04)) == 8


def test_a_request_without_an_objective_does_not_join_past_a_running_objective():
    engine, _ = make_engine(max_num_seqs=8)
    engine.add(handoff("int", tpot_slo_ms=100, max_tokens=200))  # outlives the others
    for i in range(6):
        engine.add(handoff(f"b{i}", priority=5, max_tokens=20))
    sizes = run_with_step_cost(engine, 0.03)  # 30 ms each: 3 fit in 100 ms, the 4th is measured and held
    first_end = next(i for i in range(1, len(sizes)) if sizes[i] < sizes[i - 1])
    assert max(sizes) == 4 and max(sizes[first_end:]) <= 3


def test_step_times_interpolate_and_forget():
    times = StepTimes(max_age_s=30)
    assert times.batch_limit(0.1, now=0) == 1  # nothing measured: grow by one
    for batch, seconds in [(1, 0.02), (2, 0.04), (8, 0.16)]:
        times.record(batch, seconds, now=0)
    assert times.batch_limit(0.1, now=1) == 5  # between 2 (40 ms) and 8 (160 ms), 100 ms falls at 5
    assert times.batch_limit(0.2, now=1) == 9  # every size within: one past the largest
    times.record(3, 0.5, now=1)  # a larger batch is no faster than a smaller one: 8 is as slow as 3
    assert times.batch_limit(0.1, now=2) == 2
    times.record(1, 61.0, now=1)  # longer than any step: the engine idled in between
    assert times.seconds[1][0] == 0.02
    assert times.batch_limit(0.1, now=40) == 1  # everything older than 30 s is forgotten, and measured again


def test_recent_step_times_are_the_means_of_the_last_30_s_of_steps_of_a_size():
    """What the engine reports to the gateway's TPOT check: a size's mean over its steps in the window (a burst of
    slow steps beside one long prefill moves it less than the smoothed time), once it stepped MIN_RECENT_STEPS times."""
    times = StepTimes(max_age_s=30)
    for i in range(MIN_RECENT_STEPS - 1):
        times.record(2, 0.04, now=i)
    assert times.recent_ms(now=10) == {}  # too few steps of that size yet
    times.record(2, 0.04, now=10)
    times.record(2, 0.10, now=11)
    times.record(2, 0.10, now=12)  # two slow steps beside a prefill
    assert times.recent_ms(now=12) == {2: 52.0}  # 8 x 40 ms and 2 x 100: the mean over the window
    assert times.seconds[2][0] > 0.06  # while the smoothed time, which follows the last steps, is past it
    assert times.recent_ms(now=45) == {}  # 30 s later every step is older than the window


def test_thread_share_keeps_every_thread_only_where_the_halved_step_breaks_a_tpot_objective():
    share = ThreadShare(max_age_s=30)
    assert not share.keep_threads(4, 0.0, now=0)  # no objective: halve, as before
    assert not share.keep_threads(4, 0.1, now=0)  # halved not measured yet: halve and measure it
    share.record(HALVED, 4, 0.08, now=0)
    assert not share.keep_threads(4, 0.1, now=1)  # 80 ms halved keeps 100 ms
    share.record(HALVED, 2, 0.13, now=1)  # a smaller batch already breaks it: so would 4 (the envelope)
    assert share.keep_threads(4, 0.1, now=2)  # every thread not measured: try it
    share.record(EVERY, 4, 0.06, now=2)
    assert share.keep_threads(4, 0.1, now=3)
    share.record(EVERY, 4, 0.5, now=3)  # measured slower than halved (two pools fighting over the cores)
    share.record(EVERY, 4, 0.5, now=3)
    assert not share.keep_threads(4, 0.1, now=4)
    assert not share.keep_threads(4, 0.2, now=4)  # a looser objective: halved keeps it
    assert not share.keep_threads(4, 0.1, now=40)  # both forgotten after 30 s: measured again, halved first
    share.record(HALVED, 4, 0.15, now=40)
    assert share.keep_threads(4, 0.1, now=41)


class Gate:
    enabled = True
    prefill_active = True
    held_for = 10  # the best priority queued for or in prefill: below the objective's sequences (priority 0)


def test_the_runner_keeps_its_threads_for_a_tpot_objective_and_halves_them_for_priorities_only():
    """ModelRunner._set_threads with a fake clock and gate: halved, the step of a batch with a 100 ms TPOT
    objective takes 150 ms, with every thread 70 ms; the runner tries halved, then every thread, and stays there.
    A batch without an objective halves whatever the times, and nothing halves with no prompt in prefill."""
    torch = pytest.importorskip("torch")
    from decode_gpu.runner.alone_threads import AloneThreads
    from decode_gpu.runner.model_runner import ModelRunner
    runner = object.__new__(ModelRunner)
    clock = Clock()
    runner.gate, runner.clock, runner._threads = Gate(), clock, (4, 2)
    runner.thread_share, runner._last_forward = ThreadShare(), None
    runner.alone_threads = AloneThreads()  # with no prompt in prefill (tests/decode_gpu/test_alone_threads.py)
    seqs = [types.SimpleNamespace(seq_id=f"s{i}", priority=0, tpot_slo_ms=100 if i == 0 else 0) for i in range(3)]
    before = torch.get_num_threads()
    try:
        used = []
        for _ in range(5):
            runner._set_threads(seqs)
            used.append(torch.get_num_threads())
            clock.t += 0.15 if used[-1] == 2 else 0.07
        assert used == [2, 4, 4, 4, 4]
        plain = [types.SimpleNamespace(seq_id=f"b{i}", priority=0, tpot_slo_ms=0) for i in range(3)]
        runner._set_threads(plain)
        assert torch.get_num_threads() == 2
        Gate.held_for = 0  # a prompt as important as the objective's sequences: its first token shares the cores
        runner._set_threads(seqs)
        assert torch.get_num_threads() == 2
        Gate.held_for = 10
        runner._set_threads(seqs)
        assert torch.get_num_threads() == 4
        Gate.prefill_active = False
        runner._set_threads(seqs)
        assert torch.get_num_threads() == 4
    finally:
        Gate.prefill_active, Gate.held_for = True, 10
        torch.set_num_threads(before)
