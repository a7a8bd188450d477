"""Objectives in the gateway: earliest deadline first within a priority in the prefill queue, the TTFT prediction
from the queue ahead and the measured prefill rate, the early refusal (429 slo_unattainable with Retry-After),
the x-slo-ttft-ms header (tighten, never loosen), the TPOT check from the engine's measured step times, and the SLO
metrics."""

import asyncio
import heapq
import math
import time

import pytest
from aiohttp.test_utils import make_mocked_request
from fake_engine_link import FakeEngine

from contracts.events import EngineStats
from contracts.framing import pack, unpack
from contracts.handoff import SamplingParams
from contracts.messages import PrefillDone, PrefillJob, Recompute, Stats
from edge.api.openai_request import ApiError, parse_request
from edge.config import ServeConfig
from edge.core.engine_client import EngineClient
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlight, InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.core.request_record import RequestRecord
from edge.observe.status_board import StatusBoard
from policies.enforcer import PolicyEnforcer
from policies.loader import parse_policy

POLICY = """version = 1
default_class = "interactive"
[classes.interactive]
priority = 0
ttft_slo_ms = 1000
tpot_slo_ms = 150
on_slo_miss = "reject"
min_ttft_slo_ms = 200
[classes.chat]
priority = 0
ttft_slo_ms = 1000
[classes.batch]
priority = 10
[[keys]]
key = "k-int"
class = "interactive"
[[keys]]
key = "k-chat"
class = "chat"
[[keys]]
key = "k-batch"
class = "batch"
[[tiers]]
name = "late"
enter = { slo_attainment_below = 0.9 }
exit = { slo_attainment_below = 0.95 }
[tiers.actions]
shed_classes = ["batch"]
"""


def test_the_prefill_queue_runs_the_earliest_deadline_first_within_a_priority():
    async def scenario():
        registry = InFlightRegistry()
        pool = PrefillPool({}, registry, queue_limit=16)  # no worker: everything stays queued
        for rid, priority, deadline in [("none-a", 0, 0.0), ("late", 0, 300.0), ("bg-soon", 5, 1.0),
                                        ("soon", 0, 100.0), ("none-b", 0, 0.0), ("vip", -1, 0.0)]:
            registry.add(InFlight(rid, priority))
            pool.submit(PrefillJob(rid, SamplingParams(), priority, deadline=deadline))
        return [heapq.heappop(pool.queue).job.request_id for _ in range(len(pool.queue))]

    assert asyncio.run(scenario()) == ["vip", "soon", "late", "none-a", "none-b", "bg-soon"]


def make_gateway() -> Gateway:
    pool = PrefillPool({"w0": "unix:/nonexistent"}, InFlightRegistry(), queue_limit=64)
    pool.workers["w0"].state = "ready"  # no connection: a job it takes is never sent, so it stays busy
    enforcer = PolicyEnforcer(parse_policy(POLICY, "slo.toml"))
    return Gateway(ServeConfig(), "m", pool, FakeEngine(), pool.registry, Metrics("m"), enforcer)


def admit(gateway, key, tokens=1000, slo_header=None):
    headers = {"Authorization": f"Bearer {key}"}
    if slo_header is not None:
        headers["x-slo-ttft-ms"] = slo_header
    http = make_mocked_request("POST", "/v1/completions", headers=headers)
    request = parse_request({"model": "m", "prompt": [7] * tokens, "max_tokens": 8}, "completion")
    return gateway.admit(http, request)


def measured(gateway, tokens_per_s=1000.0, handoff_ms=50.0):
    """One real prefill as a worker reports it: the rate the predictor starts from; and as many first tokens exactly
    on time as its margin reads (a predictor measured while serving: no margin; the prior margin of a fresh start is
    tested on its own)."""
    import collections

    from edge.core.ttft_predictor import MIN_ERRORS
    run = admit(gateway, "k-batch", tokens=10)
    gateway.slo.prefilled(run.inflight, PrefillDone(run.inflight.request_id, 1000, 1000 / tokens_per_s * 1e3, 0,
                                                    handoff_ms))
    gateway.pool.workers["w0"].current = None  # it finished
    gateway.slo.predictor.errors[0] = collections.deque([(time.monotonic(), 0.0)] * MIN_ERRORS)


def metric(gateway, name, **labels):
    return gateway.metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_nothing_is_refused_before_a_prefill_was_measured():
    async def scenario():
        gateway = make_gateway()
        return [admit(gateway, "k-int", tokens=5000) for _ in range(5)]
    assert len(asyncio.run(scenario())) == 5


def test_a_request_that_cannot_meet_its_objective_is_refused_at_once_with_retry_after():
    async def scenario():
        gateway = make_gateway()
        measured(gateway)  # 1000 tokens a second, 50 ms handoff
        for _ in range(3):  # each predicted within 1000 ms: 350, 650, 950 ms
            admit(gateway, "k-int", tokens=300)
        refusals = []
        for tokens in (300, 2300):  # 900 tokens ahead, then its own
            started = time.perf_counter()
            with pytest.raises(ApiError) as info:
                admit(gateway, "k-int", tokens=tokens)
            refusals.append((info.value, time.perf_counter() - started))
        return gateway, refusals

    gateway, refusals = asyncio.run(scenario())
    for (err, elapsed), expected_ms in zip(refusals, (1250, 3250)):
        assert (err.status, err.code) == (429, "slo_unattainable") and elapsed < 0.05
        predicted_ms = int(err.message.split("predicted now is ")[1].split(" ms")[0])
        assert expected_ms - 100 <= predicted_ms <= expected_ms and "1000 ms promised to class 'interactive'" in \
            err.message
        assert err.headers["Retry-After"] == str(max(1, math.ceil(predicted_ms / 1e3 - 1.0)))
    assert [err.headers["Retry-After"] for err, _ in refusals] == ["1", "3"]
    assert metric(gateway, "edge:slo_requests_total", **{"class": "interactive"}, kind="ttft",
                  outcome="refused") == 2
    assert gateway.enforcer.active["class:interactive"] == 3  # the refused requests hold no slot
    assert len(gateway.pool.queue) == 2


def test_the_predictors_recent_shortfall_is_allowed_for_and_fades():
    from edge.core.ttft_predictor import ERROR_WINDOW_S, MIN_ERRORS, Pending, TTFTPredictor
    now = [0.0]
    predictor = TTFTPredictor(None, clock=lambda: now[0])
    known = Pending("interactive", 1000, 0, 100.0, 0, predicted_s=0.2, raw_s=0.2, deadline=0.0)
    for i in range(MIN_ERRORS - 1):  # one in four first tokens 300 ms late
        predictor.first_token(known, 0.5 if i % 4 == 0 else 0.2)
    assert predictor.margin(0) == 0.0 and predictor.margin(0, 0.8) == pytest.approx(0.08)  # too few: the prior
    predictor.first_token(known, 0.2)
    assert predictor.margin(0) == pytest.approx(0.3) and predictor.margin(10) == 0.0
    assert predictor.margin(0, 0.8) == pytest.approx(0.3)  # measured: the prior no longer counts
    now[0] = ERROR_WINDOW_S + 1  # a spike leaves the window
    assert predictor.margin(0) == 0.0


def test_a_request_predicted_inside_its_objective_by_less_than_the_shortfall_is_refused():
    import collections

    async def scenario():
        gateway = make_gateway()
        measured(gateway)  # 1000 tokens a second, 50 ms handoff
        for _ in range(2):  # predicted 350, 650 ms
            admit(gateway, "k-int", tokens=300)
        late = collections.deque([(time.monotonic(), 0.2)] * 20)  # predictions 200 ms short
        gateway.slo.predictor.errors[0] = late
        with pytest.raises(ApiError) as info:  # predicted 950 ms, within 1000 but not by 200
            admit(gateway, "k-int", tokens=300)
        gateway.slo.predictor.errors[0] = collections.deque([(time.monotonic(), 0.0)] * 20)
        admit(gateway, "k-int", tokens=300)  # the same request without the shortfall
        return info.value
    err = asyncio.run(scenario())
    assert (err.status, err.code) == (429, "slo_unattainable")
    assert "predictions fell short by 200 ms or more" in err.message and err.headers["Retry-After"] == "1"


def test_a_request_with_nothing_ahead_is_never_refused():
    async def scenario():
        gateway = make_gateway()
        measured(gateway)
        alone = admit(gateway, "k-int", tokens=3000)  # its own prefill alone takes 3 s at 1000 tokens a second
        return gateway, alone
    gateway, alone = asyncio.run(scenario())
    assert gateway.slo.pending[alone.inflight.request_id].predicted_s > 3.0  # predicted late, served all the same


def test_what_waits_at_a_lower_priority_is_not_ahead_and_serve_classes_are_served():
    async def scenario():
        gateway = make_gateway()
        measured(gateway)
        for _ in range(6):
            admit(gateway, "k-batch", tokens=2000)  # 12 s of batch prompts, at priority 10
        interactive = admit(gateway, "k-int", tokens=200)  # nothing ahead at its priority: served
        admit(gateway, "k-int", tokens=200)
        late = [admit(gateway, "k-chat", tokens=2000) for _ in range(2)]  # predicted late, but its class serves
        return interactive, late
    interactive, late = asyncio.run(scenario())
    assert interactive.decision.ttft_slo_ms == 1000 and all(run.decision.client_class == "chat" for run in late)


def test_the_header_tightens_the_deadline_and_cannot_loosen_it_or_change_the_priority():
    async def scenario():
        gateway = make_gateway()
        before = time.time()
        tight = admit(gateway, "k-int", tokens=10, slo_header="300")
        plain = admit(gateway, "k-int", tokens=10)
        with pytest.raises(ApiError) as loose:
            admit(gateway, "k-int", tokens=10, slo_header="5000")
        jobs = {e.job.request_id: e.job for e in gateway.pool.queue}
        jobs[tight.inflight.request_id] = gateway.pool.workers["w0"].current.job
        return before, tight, plain, loose.value, jobs

    before, tight, plain, loose, jobs = asyncio.run(scenario())
    tight_job, plain_job = jobs[tight.inflight.request_id], jobs[plain.inflight.request_id]
    assert tight.decision.ttft_slo_ms == 300 and before + 0.3 <= tight_job.deadline <= time.time() + 0.3
    assert plain_job.deadline - tight_job.deadline == pytest.approx(0.7, abs=0.05)
    assert tight_job.priority == plain_job.priority == 0 and tight_job.tpot_slo_ms == 150
    assert (loose.status, loose.param) == (400, "x-slo-ttft-ms") and "would loosen" in loose.message


def record(run, status="finished", ttft_s=0.5, tpot_s=0.1):
    return RequestRecord(time.time(), run.inflight.request_id, None, run.decision.client_class, None, "m",
                         "completion", "", status, "stop", 200, ttft_s=ttft_s, tpot_s=tpot_s)


def test_outcomes_goodput_attainment_and_the_predictors_error_are_measured():
    async def scenario():
        gateway = make_gateway()
        measured(gateway)
        runs = [admit(gateway, "k-int", tokens=100) for _ in range(6)]
        gateway.slo.first_token(runs[0].inflight, 2.0)
        gateway.slo.observe(record(runs[0], ttft_s=0.5, tpot_s=0.1))  # both met
        gateway.slo.observe(record(runs[1], ttft_s=1.5, tpot_s=0.1))  # ttft missed
        gateway.slo.observe(record(runs[2], ttft_s=0.5, tpot_s=0.2))  # tpot missed
        gateway.slo.observe(record(runs[3], status="failed", ttft_s=None, tpot_s=None))  # a failure misses both
        gateway.slo.observe(record(runs[4], status="aborted", ttft_s=None, tpot_s=None))  # left: not judged
        gateway.slo.observe(record(runs[5], ttft_s=0.2, tpot_s=None))  # one token: no tpot
        return gateway, runs

    gateway, runs = asyncio.run(scenario())
    counts = {(kind, outcome): metric(gateway, "edge:slo_requests_total", **{"class": "interactive"}, kind=kind,
                                      outcome=outcome) or 0 for kind in ("ttft", "tpot") for outcome in ("met", "missed")}
    assert counts == {("ttft", "met"): 3, ("ttft", "missed"): 2, ("tpot", "met"): 2, ("tpot", "missed"): 2}
    classes = gateway.slo.attainment()
    assert classes["interactive"] == {"judged": 5, "attainment": 0.4, "goodput_rps": round(2 / 60, 4)}
    assert metric(gateway, "edge:slo_goodput_requests_per_second", **{"class": "interactive"}) == pytest.approx(2 / 60)
    assert gateway.slo.signals() == {"slo_attainment_below": 0.4}
    # predicted: 100 tokens at 1000/s + 50 ms handoff = 150 ms; measured 2 s
    interactive = {"class": "interactive"}
    assert metric(gateway, "edge:slo_ttft_prediction_error_seconds_count", **interactive) == 1
    # 1.85 s late (a histogram with negative buckets has no _sum): counted from the 2.5 s bucket up
    assert metric(gateway, "edge:slo_ttft_prediction_error_seconds_bucket", le="2.5", **interactive) == 1
    assert metric(gateway, "edge:slo_ttft_prediction_error_seconds_bucket", le="1.0", **interactive) == 0
    assert not any(run.inflight.request_id in gateway.slo.pending for run in runs)  # ended: forgotten


def test_the_prediction_learns_what_its_model_misses():
    async def scenario():
        gateway = make_gateway()
        measured(gateway)
        errors = []
        for _ in range(30):
            run = admit(gateway, "k-int", tokens=100)
            gateway.pool.workers["w0"].current = None
            known = gateway.slo.pending[run.inflight.request_id]
            errors.append(0.6 - known.predicted_s)  # every first token comes 450 ms after the model's 150
            gateway.slo.first_token(run.inflight, 0.6)
            gateway.slo.observe(record(run))
        return errors
    errors = asyncio.run(scenario())
    assert errors[0] == pytest.approx(0.45, abs=0.01) and abs(errors[-1]) < 0.01


def test_the_status_page_shows_attainment_and_a_tier_enters_on_it():
    async def scenario():
        gateway = make_gateway()
        runs = [admit(gateway, "k-int", tokens=10) for _ in range(5)]
        gateway.update_policy_signals()
        before = gateway.enforcer.evaluator.state.name  # too few judged yet: no signal
        for run in runs[:4]:
            gateway.slo.observe(record(run, ttft_s=3.0))  # missed
        gateway.slo.observe(record(runs[4]))  # met
        gateway.update_policy_signals()
        return gateway, before, StatusBoard(gateway).snapshot()["slo"]

    gateway, before, slo = asyncio.run(scenario())
    assert before == "normal" and gateway.enforcer.evaluator.state.name == "late"
    assert "slo_attainment_below=0.2 < 0.9" in gateway.enforcer.evaluator.state.reason
    assert slo == {"interactive": {"judged": 5, "attainment": 0.2, "goodput_rps": round(1 / 60, 4)}}
    assert metric(gateway, "edge:slo_attainment", **{"class": "interactive"}) == pytest.approx(0.2)


def test_a_recompute_keeps_its_requests_deadline():
    async def scenario():
        gateway = make_gateway()
        run = admit(gateway, "k-int", tokens=10)
        ask = Recompute(run.inflight.request_id, 0, tuple(range(12)), SamplingParams(), 0)
        gateway.recompute(ask, EngineClient("unix:/nowhere", gateway.registry))  # the one engine asks
        return run, [e.job for e in gateway.pool.queue if e.job.resume_index == 0]
    run, (job,) = asyncio.run(scenario())
    assert job.deadline == pytest.approx(time.time() + 1.0, abs=0.5) and job.request_id == run.inflight.request_id
    assert job.engine == ""  # the workers' own engine


def test_the_learned_offset_fades_without_first_tokens():
    from edge.core.ttft_predictor import Offset
    offset = Offset(now=0.0)
    offset.value.value = 4.0  # a spike learned at t = 0
    assert offset.now(30.0) == pytest.approx(2.0)
    assert offset.now(90.0) == pytest.approx(0.5)


def test_prefill_time_is_a_fixed_part_and_a_part_per_token():
    from edge.core.ttft_predictor import PrefillTime
    line = PrefillTime()
    line.add(1000, 1.0)
    assert line.seconds(100) == pytest.approx(0.1)  # one size measured: a rate
    for _ in range(20):  # 0.2 s for any prompt, then 1 ms a token
        line.add(50, 0.25)
        line.add(300, 0.5)
    fixed, per_token = line.line()
    assert fixed == pytest.approx(0.2, abs=0.02) and per_token == pytest.approx(0.001, rel=0.1)
    assert line.seconds(50) == pytest.approx(0.25, abs=0.01)  # a rate alone would say 0.11 s


def test_each_priority_learns_its_own_offset():
    async def scenario():
        gateway = make_gateway()
        measured(gateway)
        predictor = gateway.slo.predictor
        for _ in range(30):  # batch prompts wait 5 s behind what outranks them; interactive ones 100 ms
            for key, ttft_s in (("k-batch", 5.0), ("k-int", 0.25)):
                run = admit(gateway, key, tokens=100)
                gateway.pool.workers["w0"].current = None
                gateway.slo.first_token(run.inflight, ttft_s)
                gateway.slo.observe(record(run))
        return predictor.offset(0), predictor.offset(10)
    interactive, batch = asyncio.run(scenario())
    assert interactive == pytest.approx(0.1, abs=0.02) and batch > 4.0


def test_the_prefix_fresh_prompts_find_cached_is_not_predicted_as_work():
    from edge.core.ttft_predictor import TTFTPredictor
    predictor = TTFTPredictor(None)
    predictor.prefilled(PrefillDone("a", 130, 100.0, 0, 5.0, cached_tokens=30), None)  # 100 computed in 100 ms
    predictor.prefilled(PrefillDone("b", 300, 50.0, 0, 5.0, cached_tokens=250), None)  # a preempted one, resumed
    assert predictor.cached_tokens.value == 30  # the resumed one's cached chunks are not a shared prefix
    assert predictor._seconds(130) == pytest.approx(0.1, rel=0.05)  # a fresh 130-token prompt computes 100


def engine_stats(tpot_sequences: int, step_ms: dict[int, float]) -> EngineStats:
    return EngineStats(0, 100, 1600, 0, tpot_sequences, 0, 0, 0.0, 0.0, 0, step_ms=step_ms,
                       tpot_sequences=tpot_sequences)


def test_a_request_that_would_slow_the_batch_past_its_tpot_objective_is_refused():
    """interactive promises 150 ms a token: measured steps of 30 ms at 1 sequence, 120 at 4 and 200 at 8. The batch
    it would join counts the engine's sequences with objectives, the accepted ones not there yet, and itself."""
    async def scenario():
        gateway = make_gateway()
        gateway.engine = FakeEngine()
        gateway.engine.stats = engine_stats(3, {1: 30.0, 4: 120.0, 8: 200.0})
        accepted = [admit(gateway, "k-int", tokens=10) for _ in range(4)]  # batches of 4 to 7: within 120 ms
        started = time.perf_counter()
        with pytest.raises(ApiError) as refused:  # the eighth: 200 ms
            admit(gateway, "k-int", tokens=10)
        elapsed = time.perf_counter() - started
        chat = admit(gateway, "k-chat", tokens=10)  # no TPOT objective: not judged on it
        gateway.slo.first_token(accepted[0].inflight, 0.1)  # it reached the engine: its stats count it now
        gateway.engine.stats = engine_stats(4, {1: 30.0, 4: 120.0, 8: 200.0})
        with pytest.raises(ApiError):
            admit(gateway, "k-int", tokens=10)
        return gateway, refused.value, elapsed, chat

    gateway, err, elapsed, chat = asyncio.run(scenario())
    assert (err.status, err.code, err.headers["Retry-After"]) == (429, "slo_unattainable", "1") and elapsed < 0.05
    assert "time per output token predicted now is 200 ms (a decode step of 8 sequences" in err.message
    assert "150 ms promised to class 'interactive'" in err.message
    assert chat.decision.client_class == "chat"
    assert metric(gateway, "edge:slo_requests_total", **{"class": "interactive"}, kind="tpot", outcome="refused") == 2


def test_the_tpot_check_allows_for_how_served_answers_ran_against_their_predictions():
    """A request's TPOT is its mean step over the answer, not the step of the batch it joins: the check adds the
    median of (served - predicted) over the class's recent answers, once 20 of them ended."""
    import collections

    from edge.core.ttft_predictor import MIN_ERRORS

    async def scenario():
        gateway = make_gateway()
        gateway.engine = FakeEngine()
        gateway.engine.stats = engine_stats(3, {1: 30.0, 4: 120.0})
        served = admit(gateway, "k-int", tokens=10)  # predicted 120 ms, served 100 ms a token
        gateway.slo.observe(record(served, tpot_s=0.1))
        recorded = gateway.slo.tpot_errors["interactive"][-1][1]
        gateway.engine.stats = engine_stats(3, {1: 30.0, 4: 170.0})  # 170 ms: over the 150 promised
        with pytest.raises(ApiError) as first:
            admit(gateway, "k-int", tokens=10)
        gateway.slo.tpot_errors["interactive"] = collections.deque([(time.monotonic(), -30.0)] * (MIN_ERRORS - 1))
        with pytest.raises(ApiError):  # too few measured: the prediction alone
            admit(gateway, "k-int", tokens=10)
        gateway.slo.tpot_errors["interactive"].append((time.monotonic(), -30.0))
        accepted = admit(gateway, "k-int", tokens=10)  # 170 - 30 = 140 ms: within 150
        gateway.slo.tpot_errors["interactive"] = collections.deque([(time.monotonic(), -10.0)] * MIN_ERRORS)
        with pytest.raises(ApiError) as last:  # 160 ms
            admit(gateway, "k-int", tokens=10)
        return recorded, first.value, accepted, last.value

    recorded, first, accepted, last = asyncio.run(scenario())
    assert recorded == pytest.approx(-20.0) and "as measured)" in first.message
    assert accepted.decision.client_class == "interactive"
    assert "served answers' TPOT ran -10 ms from their predictions (median)" in last.message


def test_the_tpot_check_refuses_nothing_it_cannot_help_or_has_not_measured():
    async def scenario():
        gateway = make_gateway()
        gateway.engine = FakeEngine()
        gateway.engine.stats = engine_stats(0, {1: 500.0})  # alone: a refusal would make nothing faster
        alone = admit(gateway, "k-int", tokens=10)
        gateway.slo.first_token(alone.inflight, 0.1)
        gateway.engine.stats = engine_stats(1, {4: 500.0})  # 2 sequences: no size at or below it measured
        unmeasured = admit(gateway, "k-int", tokens=10)
        gateway.engine.stats = None  # no stats yet
        return [alone, unmeasured, admit(gateway, "k-int", tokens=10)]

    assert len(asyncio.run(scenario())) == 3


def test_engine_stats_carry_step_times_over_the_wire():
    stats = engine_stats(3, {1: 30.5, 8: 200.25})
    assert unpack(pack(Stats(stats))[4:]).stats == stats  # after the length prefix
