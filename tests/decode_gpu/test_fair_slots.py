"""Fair decode slots (issue 47): a request's n choices count against its share of the decode batch, so a request
with n = 32 cannot hold a plain request out of the batch beyond one step; its extra choices are paused (they keep
their blocks and decode again later), never failed. Scheduler level, no model."""

import itertools

import pytest

from contracts.handoff import SamplingParams
from decode_gpu.core import fair_share
from decode_gpu.core.block_manager import BlockManager
from decode_gpu.core.scheduler import Scheduler, SchedulerConfig
from decode_gpu.core.sequence import SeqState, Sequence

SAMPLING = SamplingParams(max_tokens=64)
ARRIVALS = itertools.count()


def request(request_id: str, n: int = 1, priority: int = 0, prompt_len: int = 6) -> Sequence:
    """A handed-off request as admission makes it: each choice its own arrival (core/admission.py)."""
    choices = [Sequence(request_id if i == 0 else f"{request_id}#{i}", priority, next(ARRIVALS), prompt_len=prompt_len,
                        tokens=list(range(prompt_len + 1)), sampling=SAMPLING, request_id=request_id, index=i)
               for i in range(n)]
    choices[0].forks = choices[1:]
    return choices[0]


def decode_one(scheduler: Scheduler, swapped: list[str] | None = None) -> list[Sequence]:
    """One step: every sequence scheduled to decode gets a token, as the engine would give it; the sequences
    swapped out on the way are appended to `swapped`."""
    step = scheduler.schedule()
    for seq in step.decode:
        seq.tokens.append(7)
        seq.num_cached += 1
    if swapped is not None:
        swapped += [seq_id for seq_id, _ in step.swap_out]
    return step.decode


def scheduler(max_num_seqs: int = 8, num_blocks: int = 512) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), BlockManager(num_blocks, block_size=4))


def test_a_plain_request_decodes_at_the_next_step_beside_a_request_whose_choices_fill_the_batch():
    s = scheduler(max_num_seqs=8)
    s.add(request("big", n=8))
    assert len(decode_one(s)) == 8  # alone, all of its choices decode
    s.add(request("plain"))
    decoded = decode_one(s)
    assert "plain" in [seq.seq_id for seq in decoded] and len(decoded) == 8
    assert sum(seq.request_id == "big" for seq in decoded) == 7
    paused = [seq for seq in s.running.values() if seq.seq_id in s.paused]
    assert len(paused) == 1 and paused[0].state is SeqState.RUNNING and paused[0].request_id == "big"
    assert s.blocks.block_tables[paused[0].seq_id]  # paused, not preempted: its KV stays in the pool
    assert not any(step_failed for step_failed in s.schedule().failed)


def test_a_paused_choice_decodes_again_once_the_other_request_ends():
    s = scheduler(max_num_seqs=4)
    s.add(request("big", n=4))
    decode_one(s)
    s.add(request("plain"))
    decode_one(s)
    (paused,) = s.paused
    before = s.running[paused].num_cached
    s.finish(s.running["plain"], "stop")
    assert paused in {seq.seq_id for seq in decode_one(s)}
    assert s.running[paused].num_cached == before + 1 and not s.paused


def test_four_big_requests_and_a_plain_one_share_the_batch_by_water_filling():
    s = scheduler(max_num_seqs=32, num_blocks=4096)
    for i in range(4):
        s.add(request(f"big{i}", n=32))
    s.add(request("plain"))
    decoded = decode_one(s)
    for _ in range(3):
        decoded = decode_one(s)
    per_request = {rid: sum(seq.request_id == rid for seq in decoded) for rid in ("big0", "big1", "big2", "big3")}
    assert "plain" in {seq.seq_id for seq in decoded} and len(decoded) == 32
    assert sorted(per_request.values()) == [7, 8, 8, 8]  # 31 slots over four requests: level 7, one left over


def test_priorities_still_come_first_a_lower_priority_plain_request_waits():
    s = scheduler(max_num_seqs=4)
    s.add(request("vip", n=4, priority=0))
    decode_one(s)
    s.add(request("low", priority=5))
    assert "low" not in {seq.seq_id for seq in decode_one(s)} and s.num_waiting == 1


def test_plain_requests_beyond_the_batch_wait_as_before():
    s = scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        s.add(request(rid))
    assert [seq.seq_id for seq in decode_one(s)] == ["a", "b"] and s.num_waiting == 1 and not s.paused


def test_short_of_blocks_the_request_with_many_choices_gives_them_up_not_the_plain_one():
    s = scheduler(max_num_seqs=4, num_blocks=12)
    s.add(request("big", n=4, prompt_len=7))  # 2 blocks of prompt, a copy per fork: 5 blocks
    decode_one(s)
    s.add(request("plain", prompt_len=7))
    decode_one(s)
    (paused,) = s.paused
    swapped = []
    for _ in range(12):  # the decoding choices grow until the pool runs short
        assert "plain" in {seq.seq_id for seq in decode_one(s, swapped)}
    assert swapped[0] == paused and all(seq_id.startswith("big") for seq_id in swapped)  # paused first, then big's
    assert s.running["plain"].num_cached == 7 + 12 + 1 and s.num_preemptions >= 2


def test_water_fill_and_allot():
    assert fair_share.water_fill([1, 32], 32) == [1, 31]
    assert fair_share.water_fill([32, 32, 32, 32, 1], 32) == [8, 8, 8, 7, 1]
    assert fair_share.water_fill([3, 2], 10) == [3, 2]
    assert fair_share.water_fill([1, 1, 1], 2) == [1, 1, 0]  # in rank order when slots are fewer than requests
    groups = [fair_share.Group("a", (0, 0.0, 0), 4), fair_share.Group("b", (1, 0.0, 1), 4),
              fair_share.Group("c", (1, 0.0, 2), 1)]
    assert fair_share.allot(groups, 6) == {"a": 4, "b": 1, "c": 1}


def test_paused_choices_do_not_count_as_running():
    """num_running (EngineStats.num_running: the status page, the gauges, the TTFT predictor's "decoding now") counts
    the sequences that decode at a step; a choice paused beyond its request's share holds KV but does not decode."""
    s = scheduler(max_num_seqs=4)
    s.add(request("big", n=4))
    decode_one(s)
    assert (s.num_running, s.num_paused) == (4, 0)
    s.add(request("plain"))
    decoded = decode_one(s)
    assert len(s.running) == 5 and len(decoded) == 4
    assert (s.num_running, s.num_paused) == (4, 1)  # the paused choice is not counted
    s.finish(s.running["plain"], "stop")
    decode_one(s)
    assert (s.num_running, s.num_paused) == (4, 0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cpu_like_scheduler(factor: float = 2.0) -> tuple[Scheduler, FakeClock]:
    """A scheduler whose steps cost what this box's CPU decode measured: about 10 ms plus 2.3 ms a row (13 ms at
    1 row, 85 ms at 32)."""
    clock = FakeClock()
    s = Scheduler(SchedulerConfig(max_num_seqs=32, share_step_factor=factor), BlockManager(4096, block_size=4),
                  clock=clock)
    return s, clock


def cpu_step(s: Scheduler, clock: FakeClock) -> list[Sequence]:
    decoded = decode_one(s)
    clock.now += 0.0104 + 0.0023 * len(decoded)  # the step's cost, timed at the next schedule()
    return decoded


def test_a_plain_request_beside_n_32_steps_at_most_twice_its_own_measured_step_on_a_cpu():
    s, clock = cpu_like_scheduler()
    s.add(request("alone"))
    for _ in range(3):
        cpu_step(s, clock)  # a batch of one measured
    s.finish(s.running["alone"], "stop")
    s.add(request("big", n=32))
    for _ in range(3):
        assert len(cpu_step(s, clock)) == 32  # alone, every choice decodes
    s.add(request("plain"))
    cpu_step(s, clock)
    decoded = cpu_step(s, clock)
    # two rows (plain + one big) step in 15 ms; twice that holds 8 rows (28.8 ms): the plain one and 7 big choices
    assert "plain" in {seq.seq_id for seq in decoded} and len(decoded) == 8
    assert s.num_paused == 25 and all(s.running[seq_id].state is SeqState.RUNNING for seq_id in s.paused)
    s.finish(s.running["plain"], "stop")
    cpu_step(s, clock)
    assert len(cpu_step(s, clock)) == 32 and not s.paused  # the plain one ended: the big request has the batch again


def test_where_the_step_does_not_grow_with_the_batch_the_big_request_keeps_its_slots():
    """On a GPU a step of 32 rows costs about what one of 1 does: no bound beyond the share of the slots."""
    s, clock = cpu_like_scheduler()
    for batch, seconds in ((1, 0.010), (32, 0.0101)):
        s.step_times.record(batch, seconds, clock.now)
    s.add(request("big", n=32))
    decode_one(s)
    s.add(request("plain"))
    decoded = decode_one(s)
    assert len(decoded) == 32 and "plain" in {seq.seq_id for seq in decoded}


def test_the_step_bound_is_off_at_factor_0_and_ignores_a_less_important_request():
    off, clock = cpu_like_scheduler(factor=0)
    for batch in (1, 32):
        off.step_times.record(batch, 0.0104 + 0.0023 * batch, clock.now)
    off.add(request("big", n=32))
    decode_one(off)
    off.add(request("plain"))
    assert len(decode_one(off)) == 32
    on, clock = cpu_like_scheduler()
    for batch in (1, 32):
        on.step_times.record(batch, 0.0104 + 0.0023 * batch, clock.now)
    on.add(request("big", n=32, priority=0))
    decode_one(on)
    on.add(request("low", priority=3))  # less important than the big request: it does not bound its share
    decoded = decode_one(on)
    assert len(decoded) == 32 and {seq.request_id for seq in decoded} == {"big"}  # priorities first, as before


def test_two_big_requests_share_the_slots_without_a_step_bound():
    """Neither is a small request to protect: each other's 32 choices are the 'others', past the batch limit."""
    s, clock = cpu_like_scheduler()
    for batch in (1, 32):
        s.step_times.record(batch, 0.0104 + 0.0023 * batch, clock.now)
    s.add(request("a", n=32))
    s.add(request("b", n=32))
    decoded = decode_one(s)
    assert len(decoded) == 32 and sum(seq.request_id == "a" for seq in decoded) == 16


def test_rows_within_fits_a_line_to_the_measured_sizes():
    from decode_gpu.core.step_times import StepTimes
    times = StepTimes()
    assert times.rows_within(2, 2.0) is None  # nothing measured
    times.record(32, 0.084, 1.0)
    assert times.rows_within(2, 2.0) is None  # one size: no line
    times.record(1, 0.013, 2.0)
    assert times.rows_within(2, 2.0) == 8  # 10.7 ms + 2.29 ms a row: 2 rows 15.3 ms, twice that at 8 rows
    assert times.rows_within(2, 1.0) == 2
    flat = StepTimes()
    flat.record(1, 0.010, 1.0)
    flat.record(32, 0.009, 2.0)
    assert flat.rows_within(2, 2.0) is None  # no growth with the batch: no bound
    assert SchedulerConfig(share_step_factor=0).share_step_factor == 0
    with pytest.raises(ValueError, match="share_step_factor"):
        SchedulerConfig(share_step_factor=0.5)


def test_rows_within_reads_the_curve_where_the_step_jumps():
    """On a CPU the weights change form past a few rows (int4, then bfloat16): the step jumps there. A line over the
    sizes put a plain request beside n = 32 at 10 rows, 4x its own step (measured: 0.76 s for 8 tokens against 0.22 s
    alone); the curve itself keeps it at the last size before the jump."""
    from decode_gpu.core.step_times import StepTimes
    times = StepTimes()
    for batch, seconds in ((1, 0.013), (2, 0.014), (4, 0.017), (5, 0.060), (32, 0.090)):
        times.record(batch, seconds, 1.0)
    assert times.rows_within(2, 2.0) == 4
    assert times.rows_within(2, 5.0) == 14  # 70 ms: a third of the way from 5 rows (60 ms) to 32 (90 ms)
    assert times.rows_within(5, 2.0) == 32 + 1  # every size past 5 within: one more than the largest measured
    times.record(3, 0.040, 2.0)  # a slower smaller size: larger ones are no faster (the envelope)
    assert times.rows_within(2, 2.0) == 2
    grows = StepTimes()
    for batch, seconds in ((1, 0.013), (2, 0.014), (3, 0.015)):
        grows.record(batch, seconds, 1.0)
    assert grows.rows_within(2, 2.0) == 4  # within at every size measured: the batch grows a row and measures it


def test_a_step_that_waited_moves_the_curve_a_little_not_to_its_wait():
    from decode_gpu.core.step_times import StepTimes
    times = StepTimes()
    times.record(1, 0.013, 1.0)
    times.record(32, 0.084, 2.0)
    times.record(1, 1.5, 3.0)  # the step waited 1.5 s for a prefill (the gate): not what a batch of one costs
    assert times.shape[1] == pytest.approx(0.013 * 1.2)
    assert times.rows_within(2, 2.0) is not None


def test_steps_beside_a_prefill_time_the_sequences_but_not_the_curve_the_share_reads():
    """A burst's small batches decode beside its prefills (on half the threads, or waiting for them): slow steps that
    are no cost of their rows. Learned as the curve, they let a plain request beside n = 32 decode at 13 rows (3x its
    own step); they still time what a sequence sees (batch_limit, the stats)."""
    s, clock = cpu_like_scheduler()
    prefill = [True]
    s.beside_prefill = lambda: prefill[0]
    s.add(request("a"))
    s.add(request("b"))
    for _ in range(3):  # two rows beside a burst's prefills: 60 ms a step
        decode_one(s)
        clock.now += 0.060
    prefill[0] = False
    for _ in range(3):  # then alone
        cpu_step(s, clock)
    assert s.step_times.shape[2] == pytest.approx(0.0104 + 0.0023 * 2)
    s.step_times.record(32, 0.0104 + 0.0023 * 32, clock.now)
    assert s.step_times.rows_within(2, 2.0) == 8  # from the steps alone; from the 60 ms ones it would be 32
    assert s.step_times.estimate(2, clock.now) > 0.0104 + 0.0023 * 2  # the sequences' own times keep the slow ones


def test_a_step_that_began_beside_a_prefill_is_none_of_the_curve_even_if_it_ended_alone():
    s, clock = cpu_like_scheduler()
    prefill = [True]
    s.beside_prefill = lambda: prefill[0]
    s.add(request("a"))
    decode_one(s)
    prefill[0] = False
    clock.now += 0.050
    decode_one(s)  # times the step that began beside the prefill
    assert 1 not in s.step_times.shape and s.step_times.estimate(1, clock.now) == pytest.approx(0.050)
