"""Issue 47, item 1: a first-ever start knows the box before its first burst. With no recorded prefill line and a
class that promises a TTFT, the gateway is not ready until a short probe ran four real prefills through the pool
(two sizes, fresh cache salts, max_tokens 0: nothing handed off) and fed their times to the predictor; bounded (a
probe past its time or a failed one is logged and readiness goes on); a start with a record pays nothing. A real
Gateway and PrefillPool; the worker is a fake that answers each job it is sent with a PrefillDone of chosen times."""

import asyncio
import logging

import pytest
from fake_engine_link import FakeEngine

from contracts.messages import PrefillDone, PrefillFailed, WorkerStatus
from edge.config import ServeConfig, default_threads
from edge.core import prefill_line, prefill_probe
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.core.ttft_predictor import CHECK_BIAS, CHECK_RATIO, TTFTPredictor
from policies.enforcer import PolicyEnforcer
from policies.loader import parse_policy
from policies.schema import ClientClass, Policy

POLICY = """version = 1
default_class = "chat"
[classes.chat]
priority = 0
ttft_slo_ms = 1000
on_slo_miss = "reject"
"""
STATUS = WorkerStatus("w0", "sha256:probe-test", 4096, "f16", 49152, prefill_weights="given: the GGUF")
FIXED_MS, PER_TOKEN_MS = 20.0, 2.0


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """No record of these fake settings reaches the real cache, where a later run would read it."""
    monkeypatch.setenv("EDGE_LLM_CACHE", str(tmp_path / "cache"))


class FakeWorker:
    """Answers each job the pool sends it, with a PrefillDone of FIXED_MS + PER_TOKEN_MS a token (or `answer`'s),
    once `go` is set; keeps the jobs."""

    def __init__(self, pool: PrefillPool, answer=None) -> None:
        self.pool, self.jobs, self.go = pool, [], asyncio.Event()
        self.answer = answer or (lambda job: PrefillDone(job.request_id, len(job.prompt_tokens),
                                                         FIXED_MS + PER_TOKEN_MS * len(job.prompt_tokens), 0, 0.0,
                                                         handed_off=False))
        self.sent = asyncio.Condition()

        async def send_frame(worker, frame):
            if worker.current is None or frame is not worker.current.frame:  # not a job (a CancelPrefill)
                return
            self.jobs.append(worker.current.job)
            async with self.sent:
                self.sent.notify_all()
            await self.go.wait()
            if worker.current is not None and worker.current.frame is frame:
                pool._on_message(worker, self.answer(worker.current.job))
        pool._send_frame = send_frame


def gateway_on(cache_dir, policy: str = POLICY) -> Gateway:
    pool = PrefillPool({"w0": "unix:/nonexistent"}, InFlightRegistry(), queue_limit=16)
    pool.workers["w0"].state, pool.workers["w0"].info = "ready", STATUS
    gateway = Gateway(ServeConfig(), "m", pool, FakeEngine(), pool.registry, Metrics("m"),
                      PolicyEnforcer(parse_policy(policy, "p.toml")))
    gateway.slo.predictor.cache_dir = cache_dir
    gateway.probe_pending = prefill_probe.wanted(gateway.enforcer.policy)
    return gateway


def test_a_first_start_measures_the_prefill_line_before_it_is_ready(tmp_path, caplog):
    async def scenario():
        gateway = gateway_on(tmp_path)
        worker = FakeWorker(gateway.pool)
        probing = asyncio.create_task(prefill_probe.measure_at_start(gateway))
        async with worker.sent:
            await worker.sent.wait_for(lambda: worker.jobs)
        # the engine and the worker are up, the probe is under way: not ready, and nothing predicted yet
        ready_while_probing = gateway.ready, gateway.components_ready
        predicted_before = gateway.slo.predictor.predict(0, 0.0, 130, {})
        worker.go.set()
        await asyncio.wait_for(probing, 5)
        return gateway, worker.jobs, ready_while_probing, predicted_before

    with caplog.at_level(logging.INFO, logger="edge.core.prefill_probe"):
        gateway, jobs, ready_while_probing, predicted_before = asyncio.run(scenario())
    assert ready_while_probing == (False, True) and predicted_before is None
    assert gateway.ready and not gateway.probe_pending and not gateway.registry.requests
    assert sorted(len(job.prompt_tokens) for job in jobs) == [16, 16, 128, 128]
    assert all(job.sampling.max_tokens == 0 for job in jobs)  # computed, never handed to the engine
    assert len({job.cache_salt for job in jobs}) == 4  # the prompt cache cannot serve one from another
    assert all(t >= prefill_probe.FIRST_TOKEN_ID for job in jobs for t in job.prompt_tokens)
    fixed_s, per_token_s = gateway.slo.predictor.prefill.line()
    assert fixed_s == pytest.approx(FIXED_MS / 1e3) and per_token_s == pytest.approx(PER_TOKEN_MS / 1e3)
    _, raw, _ = gateway.slo.predictor.predict(0, 0.0, 130, {})
    assert raw == pytest.approx((FIXED_MS + PER_TOKEN_MS * 130) / 1e3)
    assert gateway.slo.predictor.handoff_s.value is None  # nothing was handed off: no handoff time learned
    assert "slo: prefill line measured at start: 20 ms + 2.00 ms/token" in caplog.text
    assert not list((tmp_path / prefill_line.FOLDER).glob("*"))  # a probe alone is never recorded


def test_a_start_with_a_recorded_line_checks_it_and_a_slower_box_scales_it(tmp_path, caplog):
    """Recorded: 30 ms + 1 ms a token. The check's prefills take 20 ms + 2 ms a token: 16 tokens 1.13x, 128 tokens
    1.75x (twice): the median 1.75 over the check's bias (its prefills compute the prompt only) scales the line."""
    earlier = TTFTPredictor(gateway_on(tmp_path).pool, cache_dir=tmp_path, threads=default_threads(ServeConfig()))
    for i in range(prefill_line.MIN_RECORDED):
        tokens = 40 if i % 2 else 400
        earlier.prefilled(PrefillDone(f"p{i}", tokens, 30.0 + tokens, 0, 50.0), None)

    async def scenario():
        gateway = gateway_on(tmp_path)
        worker = FakeWorker(gateway.pool)
        worker.go.set()
        await asyncio.wait_for(prefill_probe.measure_at_start(gateway), 5)
        return gateway, worker.jobs

    with caplog.at_level(logging.INFO, logger="edge.core.prefill_probe"):
        gateway, jobs = asyncio.run(scenario())
    assert sorted(len(job.prompt_tokens) for job in jobs) == [16, 128, 128]
    assert all(job.sampling.max_tokens == 0 for job in jobs) and gateway.ready
    fixed_s, per_token_s = gateway.slo.predictor.prefill.line()
    scale = 1.75 / CHECK_BIAS
    assert fixed_s == pytest.approx(0.030 * scale, rel=0.01) and per_token_s == pytest.approx(0.001 * scale, rel=0.01)
    assert gateway.slo.predictor.prefill.num_measured == 0  # a check is no measurement of its own: never recorded
    assert f"scaled {scale:.2f}x" in caplog.text


def test_the_check_ratio_is_bounded_and_scales_the_beside_line_only_upward():
    predictor = TTFTPredictor(None)
    predictor.prefill.add(40, 0.070)
    predictor.prefill.add(400, 0.430)
    predictor.beside.add(40, 0.140)
    predictor.beside.add(400, 0.860)
    before = predictor.beside.seconds(100)
    slow = [PrefillDone("c", 128, 100 * (30 + 128), 0, 0.0, handed_off=False)]  # 100x: bounded
    assert predictor.check_record(slow) == CHECK_RATIO[1]
    assert predictor.beside.seconds(100) == pytest.approx(before * CHECK_RATIO[1])
    assert predictor.check_record([]) is None
    scaled = predictor.beside.seconds(100)
    fast = [PrefillDone("c", 128, 0.01, 0, 0.0, handed_off=False)]  # far faster alone: bounded, beside unchanged
    assert predictor.check_record(fast) == CHECK_RATIO[0]
    assert predictor.beside.seconds(100) == pytest.approx(scaled)


def test_a_probe_that_takes_too_long_is_cancelled_and_readiness_goes_on(tmp_path, caplog):
    async def scenario():
        gateway = gateway_on(tmp_path)
        worker = FakeWorker(gateway.pool)  # never told to answer
        await asyncio.wait_for(prefill_probe.measure_at_start(gateway, timeout_s=0.2), 5)
        return gateway, worker

    with caplog.at_level(logging.WARNING, logger="edge.core.prefill_probe"):
        gateway, worker = asyncio.run(scenario())
    assert gateway.ready and not gateway.slo.predictor.prefill.measured
    assert not gateway.pool.queue and not gateway.registry.requests  # every probe job withdrawn
    assert "not measured at start within 0 s" in caplog.text


def test_a_failed_probe_prefill_is_logged_and_the_others_still_count(tmp_path, caplog):
    def answer(job):
        if len(job.prompt_tokens) == 16:
            return PrefillFailed(job.request_id, "internal", "llama_decode returned 1")
        return PrefillDone(job.request_id, 128, 300.0, 0, 0.0, handed_off=False)

    async def scenario():
        gateway = gateway_on(tmp_path)
        FakeWorker(gateway.pool, answer).go.set()
        await asyncio.wait_for(prefill_probe.measure_at_start(gateway), 5)
        return gateway

    with caplog.at_level(logging.WARNING, logger="edge.core.prefill_probe"):
        gateway = asyncio.run(scenario())
    assert gateway.ready and gateway.slo.predictor.prefill.num_measured == 2
    assert caplog.text.count("llama_decode returned 1") == 2


def test_only_a_policy_that_promises_a_ttft_waits_for_the_probe():
    assert not prefill_probe.wanted(Policy("t"))
    assert prefill_probe.wanted(Policy("t", classes={"c": ClientClass("c", ttft_slo_ms=500)}))
    assert prefill_probe.wanted(Policy("t", classes={"c": ClientClass("c", min_ttft_slo_ms=200)}))


def test_a_request_during_the_probe_is_told_the_model_is_loading(tmp_path):
    gateway = gateway_on(tmp_path)
    err = gateway._not_ready_error()
    assert (err.status, err.code) == (503, "loading") and "measuring" in err.message


def test_the_chat_format_is_read_before_ready_not_by_the_first_burst(tmp_path, monkeypatch):
    """Every chat request awaits the model's chat format before its admission is judged; read at start, the first
    burst's refusals do not wait for jinja2's import and the template's compile (129 ms for 64 requests at once)."""
    from edge.chat import tool_formats
    read: list[tuple] = []

    def model_chat_format(*key):
        read.append(key)
        return "the format"
    monkeypatch.setattr(tool_formats, "_KNOWN", {})
    monkeypatch.setattr(tool_formats, "model_chat_format", model_chat_format)

    async def scenario():
        gateway = gateway_on(tmp_path)
        worker = FakeWorker(gateway.pool)
        probing = asyncio.create_task(prefill_probe.measure_at_start(gateway))
        async with worker.sent:
            await worker.sent.wait_for(lambda: worker.jobs)
        read_before_ready = list(read)
        worker.go.set()
        await asyncio.wait_for(probing, 5)
        answer = await tool_formats.chat_format_of(*read[0])
        return gateway, read_before_ready, answer

    gateway, read_before_ready, answer = asyncio.run(scenario())
    config = gateway.config
    assert len(read_before_ready) == 1 and read_before_ready[0][1:] == (config.tool_call_parser,
                                                                         config.reasoning_parser)
    assert answer == "the format" and len(read) == 1  # a request's read finds it known


def test_a_chat_format_that_cannot_be_read_does_not_hold_readiness(tmp_path, monkeypatch, caplog):
    from edge.chat import tool_formats

    def broken(*key):
        raise ValueError("no template")
    monkeypatch.setattr(tool_formats, "_KNOWN", {})
    monkeypatch.setattr(tool_formats, "model_chat_format", broken)

    async def scenario():
        gateway = gateway_on(tmp_path)
        worker = FakeWorker(gateway.pool)
        worker.go.set()
        await asyncio.wait_for(prefill_probe.measure_at_start(gateway), 5)
        return gateway

    with caplog.at_level(logging.ERROR, logger="edge.core.prefill_probe"):
        gateway = asyncio.run(scenario())
    assert gateway.ready and "reading the model's chat format at start failed" in caplog.text
