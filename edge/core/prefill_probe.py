"""The prefill line measured at start (issue 47), for a first-ever start: with no line recorded by an earlier run
(edge.core.prefill_line), the TTFT predictor knew nothing until the first real prefill ended, so a burst sent right
after start was all admitted and missed its objectives. When some class promises a TTFT, the gateway now holds its
readiness until a few short real prefills ran through the pool: two prompt sizes, each twice, each under a fresh
cache salt (no prompt-cache hit) and with max_tokens 0 (the worker computes the prompt and hands nothing to an
engine: prefill_cpu/prefill_worker.py), their times fed to the predictor's line (SloControl.probed). A probe is short
and never trusted alone (docs/DESIGN: "a start-up probe is short and never trusted alone"): real prefills move the
line from the first one on, and it is recorded only once MIN_RECORDED prefills were measured. Bounded: a probe past
PROBE_TIMEOUT_S, or one that fails, is logged and readiness goes on without it. A start whose policy promises no TTFT
pays nothing.

A start with a recorded line checks it (`check`): three short prefills (16, 128, 128 tokens) at once, their times
against the record's line. The median ratio, over CHECK_BIAS (a check's prefill computes the prompt only, so it runs
faster than a request's) and within CHECK_RATIO, scales the recorded lines alone and beside decoding
(TTFTPredictor.check_record). Measured (issue 47): a freshly started worker's first prefills ran 1.5-2.6x the line the
earlier start recorded while warm, so a burst right after start was over-admitted from the record alone; the check's
prefills also take those first-call costs off the burst's."""

from __future__ import annotations

import asyncio
import logging
import uuid

from contracts.handoff import SamplingParams
from contracts.messages import PrefillDone, PrefillJob
from edge.chat.tool_formats import chat_format_of
from edge.core.lifecycle import InFlight
from edge.core.ttft_predictor import CHECK_BIAS
from prefill_cpu.embedded_model import embedded_model_path

log = logging.getLogger("edge.core.prefill_probe")
PROBE_TOKENS = (16, 128, 16, 128)  # two sizes, so the line's fixed part and per-token part can be told apart
CHECK_TOKENS = (16, 128, 128)  # a recorded line's check at start
PROBE_TIMEOUT_S = 5.0  # on a busy box; about 1 s of prefill on a 2-core one
PROBE_POLL_S = 0.05  # how often the start-up looks whether the engine and a worker are up
FIRST_TOKEN_ID = 1000  # the probe prompts' token ids start past the special tokens at the vocabulary's start


def wanted(policy) -> bool:
    """Some class promises a TTFT (its own objective, or one a request's header may ask for)."""
    return any(c.ttft_slo_ms or c.min_ttft_slo_ms for c in policy.classes.values())


async def measure_at_start(gateway, timeout_s: float = PROBE_TIMEOUT_S, poll_s: float = PROBE_POLL_S) -> None:
    """Once the engine and a worker are up: the probe when no line is known for these settings, then the gateway is
    ready (Gateway.probe_pending cleared, whatever happened)."""
    try:
        while not gateway.components_ready:
            await asyncio.sleep(poll_s)
        await warm_chat_format(gateway)
        recorded = gateway.slo.predictor.known()  # an earlier run's record (prefill_line logged it)
        try:
            await asyncio.wait_for(check(gateway) if recorded else probe(gateway), timeout_s)
        except TimeoutError:
            log.warning("slo: the prefill line was not measured at start within %.0f s; TTFT predictions start with "
                        "the first real prefill", timeout_s)
        except Exception:  # a probe must never keep the gateway from serving
            log.exception("slo: measuring the prefill line at start failed; TTFT predictions start with the first "
                          "real prefill")
    finally:
        gateway.probe_pending = False


async def warm_chat_format(gateway) -> None:
    """Read the model's chat format (edge.chat.tool_formats: its template compiled by jinja2, imported then) before
    ready, so the first burst does not. Every chat request awaits it before its admission is judged, so on a fresh
    gateway a burst's 64 requests each read it at once on the default executor's threads: 129 ms on an idle 2-core
    box before the first could be refused (measured; 0.3 ms once read), and the refusals of a burst sent
    at ready took 131-282 ms at the client against 24-53 ms for the same burst a few seconds later."""
    try:
        path = gateway.config.model or embedded_model_path()
        await chat_format_of(path, gateway.config.tool_call_parser, gateway.config.reasoning_parser)
    except Exception:  # the first chat request reads it again and answers what went wrong
        log.exception("slo: reading the model's chat format at start failed")


async def probe(gateway) -> None:
    """PROBE_TOKENS prompts through the pool at once; each PrefillDone goes to the predictor's line."""
    for done in await prefills(gateway, PROBE_TOKENS):
        gateway.slo.probed(done)
    line = gateway.slo.predictor.prefill
    if line.measured:
        fixed_s, per_token_s = line.line()
        log.info("slo: prefill line measured at start: %.0f ms + %.2f ms/token (%d prefills of %s tokens)",
                 fixed_s * 1e3, per_token_s * 1e3, line.num_measured, "/".join(map(str, sorted(set(PROBE_TOKENS)))))


async def check(gateway) -> None:
    """CHECK_TOKENS prompts through the pool at once, against the recorded line (TTFTPredictor.check_record)."""
    done = await prefills(gateway, CHECK_TOKENS)
    ratio = gateway.slo.predictor.check_record(done)
    if ratio is not None:
        fixed_s, per_token_s = gateway.slo.predictor.prefill.line()
        log.info("slo: the recorded prefill line checked at start by %d prefills: scaled %.2fx (their median ratio to "
                 "it, over the check's bias %.2f); predictions start from %.0f ms + %.2f ms/token", len(done), ratio,
                 CHECK_BIAS, fixed_s * 1e3, per_token_s * 1e3)


async def prefills(gateway, sizes: tuple[int, ...]) -> list[PrefillDone]:
    """Prompts of these sizes through the pool at once (probe_job); the PrefillDone of each that did not fail."""
    pool, registry = gateway.pool, gateway.registry
    jobs = [probe_job(tokens, pool.vocab_size or 32000) for tokens in sizes]
    waiting = [InFlight(job.request_id, job.priority, needs_engine=False) for job in jobs]
    for inflight in waiting:
        registry.add(inflight)
    answered: set[str] = set()
    done: list[PrefillDone] = []
    try:
        for job in jobs:
            pool.submit(job)
        for inflight in waiting:
            message = await inflight.events.get()
            answered.add(inflight.request_id)
            if isinstance(message, PrefillDone):
                done.append(message)
            else:
                log.warning("slo: a prefill of the start-up probe failed: %s", getattr(message, "message", message))
    finally:
        for inflight in waiting:
            if inflight.request_id not in answered:
                await pool.cancel(inflight.request_id)
            registry.remove(inflight.request_id)
    return done


def probe_job(num_tokens: int, vocab_size: int) -> PrefillJob:
    """A prompt of num_tokens ordinary token ids, its own cache salt (nothing cached can serve it), max_tokens 0
    (computed, nothing handed off)."""
    span = max(1, vocab_size - FIRST_TOKEN_ID) if vocab_size > FIRST_TOKEN_ID else vocab_size
    base = FIRST_TOKEN_ID if vocab_size > FIRST_TOKEN_ID else 0
    tokens = tuple(base + (i * 37) % span for i in range(num_tokens))
    key = uuid.uuid4().hex
    return PrefillJob(f"slo-probe-{key}", SamplingParams(temperature=0.0, max_tokens=0), prompt_tokens=tokens,
                      max_prompt_tokens=num_tokens, cache_salt=f"slo-probe-{key}")
