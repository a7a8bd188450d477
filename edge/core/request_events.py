"""One accepted request's messages as its handler takes them: the prefill outcome (absorbed into the request's
marks, metrics and the SLO predictor), then the engine's token events, each timed; a failure raises ApiError."""

from __future__ import annotations

import asyncio
import logging
import time

from contracts.events import FinishReason, TokenEvent
from contracts.messages import EmbedDone, PrefillDone, PrefillFailed, PromptLogprobs
from edge.api.errors import decode_error, prefill_error
from edge.api.openai_request import ApiError
from edge.config import ServeConfig
from edge.core.engine_link import EngineLink
from edge.core.lifecycle import RequestStatus
from edge.core.metrics import Metrics
from edge.core.run import Run
from edge.core.slo import SloControl
from policies.signals import TTFTWindow

log = logging.getLogger("edge.core.request_events")
# how long a request that ended before its worker's PrefillDone arrived waits for it (milliseconds, normally)
PREFILL_REPORT_WAIT_S = 1.0


class RequestEvents:
    def __init__(self, config: ServeConfig, engine: EngineLink, metrics: Metrics, slo: SloControl,
                 ttft_window: TTFTWindow) -> None:
        self.config, self.engine, self.metrics, self.slo, self.ttft_window = config, engine, metrics, slo, ttft_window

    def context_tokens(self) -> int:
        """What one request may hold in the decode engine: the model length, or the whole KV pool if smaller."""
        pool = self.engine.stats.kv_capacity_tokens if self.engine.stats else self.config.max_model_len
        return min(self.config.max_model_len, pool)

    async def _next(self, run: Run):
        remaining = run.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(run.inflight.events.get(), timeout=max(0.0, remaining))
        except TimeoutError:
            raise ApiError(504, f"the request did not finish within {self.config.limits.request_timeout_s:.0f} s",
                           error_type="server_error", code="timeout") from None

    async def next_event(self, run: Run) -> TokenEvent:
        """The next engine event for this run. Prefill outcomes are absorbed; failures raise ApiError."""
        while True:
            message = await self._next(run)
            if isinstance(message, PrefillDone):
                self._prefilled(run, message)
                if not message.handed_off:  # max_tokens 0: the prompt was all there was to compute
                    return self._token(run, TokenEvent.ending(run.inflight.request_id, FinishReason.LENGTH,
                                                              num_prompt_tokens=message.num_prompt_tokens))
            elif isinstance(message, PromptLogprobs):
                run.prompt_logprobs = message
            elif isinstance(message, PrefillFailed):
                raise prefill_error(message, self.context_tokens(), "messages" if run.request.messages else "prompt")
            else:
                # handed_off_at is set when the worker's PrefillDone is taken in (_prefilled)
                if message.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) \
                        and run.inflight.handed_off_at is None:
                    await self._await_prefill_report(run)
                return self._token(run, message)

    async def _await_prefill_report(self, run: Run) -> None:
        """The engine sends the first token as the handoff lands, before the worker has reported the prefill, so
        a short answer (max_tokens 1) can end before its PrefillDone arrives. Its usage (cached tokens) and the
        prefill metrics come from that report: wait for it a moment rather than end the request without it."""
        deadline = time.monotonic() + PREFILL_REPORT_WAIT_S
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                message = await asyncio.wait_for(run.inflight.events.get(), timeout=remaining)
            except TimeoutError:
                break
            if isinstance(message, PrefillDone):
                self._prefilled(run, message)
                return
            if isinstance(message, PromptLogprobs):
                run.prompt_logprobs = message
            elif isinstance(message, PrefillFailed):  # it handed off, then lost the engine: no report comes
                return
        log.warning("%s ended before its prefill worker reported the prefill (waited %.1f s); its usage and the "
                    "prefill metrics lack that prefill", run.inflight.request_id, PREFILL_REPORT_WAIT_S)

    async def embeddings(self, run: Run, param: str = "input") -> EmbedDone:
        """The worker's answer to an embeddings (or rerank) request; failures raise ApiError, a too-long input
        naming `param`, the field it came in."""
        while True:
            message = await self._next(run)
            if isinstance(message, EmbedDone):
                m = self.metrics
                m.label(m.prompt_tokens).inc(sum(message.num_tokens))
                return message
            if isinstance(message, PrefillFailed):
                raise prefill_error(message, 0, param)
            if isinstance(message, TokenEvent):  # the gateway ends every request so (shutting down, an engine lost)
                self._token(run, message)  # raises for an abort or a failure

    def _prefilled(self, run: Run, done: PrefillDone) -> None:
        self.slo.prefilled(run.inflight, done)  # the measured prefill rate the TTFT prediction uses
        if done.resumed:  # a recompute of a preempted choice: the request's own prefill is counted already
            return
        inflight = run.inflight
        inflight.advance(RequestStatus.HANDED_OFF)
        # the engine sends the first token as the handoff lands, so it may overtake the worker's report
        inflight.handed_off_at = min(time.perf_counter(), inflight.first_token_at or float("inf"))
        m = self.metrics
        if inflight.prefill_started_at is not None:
            m.label(m.queue_time).observe(inflight.prefill_started_at - inflight.created)
            m.label(m.prefill_time).observe(inflight.handed_off_at - inflight.prefill_started_at)
        inflight.num_prompt_tokens = done.num_prompt_tokens
        run.cached_tokens = done.cached_tokens
        m.label(m.prompt_tokens).inc(done.num_prompt_tokens)
        m.label(m.prefix_cache_queries, where="worker").inc(done.num_prompt_tokens)
        m.label(m.prefix_cache_hits, where="worker").inc(done.cached_tokens)
        m.label(m.handoff_bytes).observe(done.handoff_bytes)
        m.label(m.handoff_seconds).observe(done.handoff_ms / 1e3)
        if done.handed_off and (link := self.engine.links().get(inflight.engine)) is not None:
            link.handed_off(inflight)  # an engine the gateway cannot hear now ends it at once

    def _token(self, run: Run, event: TokenEvent) -> TokenEvent:
        now = time.perf_counter()
        inflight, m = run.inflight, self.metrics
        if event.token_ids:
            if inflight.first_token_at is None:
                inflight.first_token_at = now
                m.label(m.ttft).observe(now - inflight.created)
                self.ttft_window.add(now - inflight.created)
                self.slo.first_token(inflight, now - inflight.created)
            elif inflight.last_token_at is not None:
                m.label(m.itl).observe(now - inflight.last_token_at)
            inflight.last_token_at = now
            m.label(m.generation_tokens).inc(len(event.token_ids))
        inflight.advance(RequestStatus.DECODING)
        if event.finish_reason is FinishReason.ERROR:
            raise decode_error(event)
        if event.finish_reason is FinishReason.ABORT:
            raise ApiError(503, "the request was aborted by the server (shutting down or restarting)",
                           error_type="server_error", code="aborted")
        return event
