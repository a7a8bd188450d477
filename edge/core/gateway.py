"""The gateway's request flow: filters before any model work, then prefill queue -> engine -> events.

Every accepted request is in the InFlightRegistry until it reaches exactly one terminal state
(finished, aborted or failed), which is counted in /metrics and told to the client.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from aiohttp import web

from contracts.events import EngineStats, TokenEvent
from contracts.messages import ChatMessage, EmbedDone, PrefillFailed, PrefillJob, Recompute
from contracts.tasks import spawn
from edge.api.errors import model_not_found, policy_error
from edge.api.openai_request import ApiError, GenerateRequest
from edge.config import ServeConfig, default_threads
from edge.core.affinity import prefix_key
from edge.core.cache_salt import CacheSalter, secret_file
from edge.core.engine_client import EngineClient
from edge.core.engine_link import EMPTY_STATS, EngineLink
from edge.core.lifecycle import InFlight, InFlightRegistry, RequestStatus
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool, QueueFullError, UnsendableJobError
from edge.core.request_events import RequestEvents
from edge.core.request_record import RequestRecord, ended_record
from edge.core.run import Run, bearer_key, route_of, tenant_of
from edge.core.slo import SloControl
from policies.enforcer import Decision, PolicyEnforcer, PolicyRejection, RequestFacts
from policies.quota import key_id
from policies.signals import TTFTWindow, box_signals
from policies.slo import HEADER as SLO_HEADER

log = logging.getLogger("edge.core.gateway")
LOAD_WAIT = web.RequestKey("model_load_wait_s", float)  # set by the route when the request waited for its model's load
POOLED_KINDS = {"embedding": "embed", "rerank": "rank"}  # request kinds a worker answers alone -> PrefillJob.task
__all__ = ["Gateway", "Run", "bearer_key", "key_id", "route_of"]


class Gateway:
    def __init__(self, config: ServeConfig, model_name: str, pool: PrefillPool, engine: EngineLink,
                 registry: InFlightRegistry, metrics: Metrics, enforcer: PolicyEnforcer) -> None:
        self.config = config
        self.model_name = model_name
        self.pool, self.engine, self.registry, self.metrics = pool, engine, registry, metrics
        self.enforcer = enforcer
        self.ttft_window = TTFTWindow()
        self.salter = CacheSalter(secret_file=secret_file(config))
        self.shutting_down = False
        # an embedding GGUF served on its own (contracts.model_kind): no decode engine; generation routes answer 400
        self.embedding_only = False
        self.observers: list = []  # callables taking a RequestRecord, called once per request on the event loop
        # objectives: deadlines, TTFT prediction, early refusal, attainment; the prefill line's record is keyed by the
        # workers' real thread count (threads_per_worker, else cores / workers)
        self.slo = SloControl(pool, metrics, threads=default_threads(config))
        self.observers.append(self.slo.observe)
        self.events = RequestEvents(config, engine, metrics, self.slo, self.ttft_window)
        # edge.app sets it when the policy promises a TTFT: not ready until the start-up probe of the prefill line
        # ended (edge.core.prefill_probe, bounded in time), so the first burst is already predicted
        self.probe_pending = False

    @property
    def ready(self) -> bool:
        return self.components_ready and not self.probe_pending

    @property
    def components_ready(self) -> bool:
        """The engine and a prefill worker are up (the start-up probe may still run)."""
        return (self.embedding_only or self.engine.state == "ready") and self.pool.num_ready > 0

    def check_key(self, request: web.Request) -> None:
        """For routes without a body (/v1/models): only the API key matters."""
        if self.enforcer.auth_required and bearer_key(request) not in self.enforcer.policy.keys:
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                           error_type="authentication_error", code="invalid_api_key")

    def check_model(self, name: str, http: web.Request | None = None) -> None:
        """A 404 (model_not_found) unless the model is served here and the policy admits it (its allowed_models,
        and with `http` its key's or class's models)."""
        served = {self.model_name}
        if http is None:
            allowed = self.enforcer.policy.filters.allowed_models
            available = [self.model_name] if not allowed or self.model_name in allowed else []
        else:
            available = sorted(self.enforcer.models_for(bearer_key(http), tenant_of(http, self.enforcer.policy),
                                                        served))
        if name not in available:
            raise model_not_found(name, available)

    def admit(self, http: web.Request, request: GenerateRequest) -> Run:
        """The policy decides (auth, class, filters, limits, degradation), then the prompt is queued.
        Raises ApiError to refuse; nothing has touched a model yet."""
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", error_type="server_error", code="shutting_down",
                           headers={"Connection": "close", "Retry-After": "5"})
        tenant = tenant_of(http, self.enforcer.policy)
        facts = RequestFacts(bearer_key(http), tenant, request.model, request.user_text,
                             request.sampling.max_tokens, request.sampling.logprobs, request.sampling.n,
                             slo_ttft_ms=http.headers.get(SLO_HEADER))
        try:
            decision = self.enforcer.decide(facts, {self.model_name})
        except PolicyRejection as err:
            raise policy_error(err) from None
        try:
            run = self._queue(request, decision, self.cache_salt(http, request))
        except ApiError:
            self.enforcer.release(decision)
            raise
        run.key_id, run.tenant, run.client = key_id(bearer_key(http)), tenant, http.remote or ""
        run.route = route_of(http)
        if waited := http.get(LOAD_WAIT, 0.0):  # its model's load counts in its TTFT, the record and the trace
            run.inflight.load_wait_s = waited
            run.inflight.created -= waited
        return run

    def cache_salt(self, http: web.Request, request: GenerateRequest) -> str:
        """Whose cached work the request may reuse (edge.core.cache_salt): its prompts' KV, and the structured-output
        compiles the route checks its constraint against before admit."""
        policy = self.enforcer.policy
        return self.salter.salt(policy.prefix_cache_scope, key_id(bearer_key(http)), tenant_of(http, policy),
                                request.cache_salt, policy.prefix_cache_groups.get(bearer_key(http) or ""))

    def _queue(self, request: GenerateRequest, decision: Decision, salt: str) -> Run:
        pooled = request.kind in POOLED_KINDS  # computed by a worker alone: no engine takes part
        if not (self.pool.num_ready > 0 if pooled else self.ready):
            raise self._not_ready_error(pooled)
        stats = self.engine_stats
        if not pooled and stats.backlog_limit_bytes and stats.backlog_bytes >= stats.backlog_limit_bytes:
            raise ApiError(503, f"the decode engine's backlog is full ({stats.backlog_bytes >> 20} MiB of KV "
                                f"handoffs waiting); retry shortly", error_type="server_error", code="engine_busy",
                           headers={"Retry-After": "2"})
        if request.sampling.n > self.config.max_num_seqs:  # the engine runs a request's choices together
            raise ApiError(400, f"n = {request.sampling.n} choices, this server decodes at most "
                                f"{self.config.max_num_seqs} sequences together (max_num_seqs)", "n", "invalid_value")
        priority = request.priority if request.priority is not None else decision.priority
        # may refuse: 429 slo_unattainable
        decision, slo = self.slo.judge(decision, request, priority, self.enforcer, self.engine.stats)
        sampling = request.sampling.decided(decision.max_tokens, decision.logprobs)
        request = dataclasses.replace(request, sampling=sampling)
        prefix = {"chat": "chatcmpl-", "embedding": "embd-", "rerank": "rerank-"}.get(request.kind, "cmpl-")
        inflight = InFlight(prefix + uuid.uuid4().hex, priority, cache_salt=salt, needs_engine=not pooled)
        messages = tuple(ChatMessage(m["role"], m["content"], m.get("tool_calls_json", ""), m.get("tool_call_id", ""))
                         for m in request.messages) if request.messages else None
        job = PrefillJob(inflight.request_id, sampling.params(), priority, prompt=request.prompt,
                         deadline=slo.deadline, tpot_slo_ms=decision.tpot_slo_ms,
                         messages=messages, prompt_tokens=request.prompt_tokens,
                         max_prompt_tokens=decision.max_prompt_tokens, kv_type=decision.kv_type,
                         max_total_tokens=self.events.context_tokens(), cache_salt=salt,
                         prompt_logprobs=-1 if request.prompt_logprobs is None else request.prompt_logprobs,
                         task=POOLED_KINDS.get(request.kind, "generate"),
                         embed_texts=request.embed_texts, embed_tokens=request.embed_tokens,
                         tools=request.template_tools)
        inflight.prefix_key = prefix_key(request.prompt, request.messages, request.prompt_tokens,
                                         f"{decision.kv_type}/{salt}")
        self.registry.add(inflight)
        try:
            self.pool.submit(job)
        except QueueFullError as err:
            self.registry.remove(inflight.request_id)
            raise ApiError(429, str(err), error_type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "2"}) from None
        except UnsendableJobError as err:
            self.registry.remove(inflight.request_id)
            raise ApiError(400, str(err), code="invalid_value") from None
        self.slo.queued(inflight, slo)
        return Run(inflight, request, decision, time.monotonic() + self.config.limits.request_timeout_s)

    def recompute(self, ask: Recompute, client: EngineClient) -> None:
        """The engine preempted a choice by recompute (preemption_mode "recompute"): have a worker prefill its tokens
        again at its priority and hand them back to that engine. The request itself goes on decoding; if the
        recompute cannot be queued, the request ends with 503 (its handler then ends it in the engine too)."""
        inflight = self.registry.get(ask.request_id)
        if inflight is None or inflight.status.terminal:  # it ended meanwhile: the engine must not keep waiting
            spawn(client.abort(ask.request_id), f"ending {ask.request_id}", log)
            return
        job = PrefillJob(ask.request_id, dataclasses.replace(ask.sampling, n=1), ask.priority,
                         prompt_tokens=ask.tokens, max_prompt_tokens=len(ask.tokens), resume_index=ask.index,
                         engine=client.job_address(),  # one engine: the workers' own
                         cache_salt=inflight.cache_salt, deadline=self.slo.deadline_of(ask.request_id))
        try:
            self.pool.submit(job)
        except (QueueFullError, UnsendableJobError) as err:
            log.warning("cannot recompute %s: %s", ask.request_id, err)
            self.registry.deliver(ask.request_id, PrefillFailed(
                ask.request_id, "recompute_failed", f"the request was preempted for a more important one and could "
                                                    f"not be queued again: {err}; retry shortly"))
            return
        log.info("recomputing choice %d of %s (%d tokens) at priority %d", ask.index, ask.request_id, len(ask.tokens),
                 ask.priority)

    def _not_ready_error(self, workers_only: bool = False) -> ApiError:
        """Loading at start; afterwards a component is restarting (or unreachable): say which. workers_only: the
        request needs no engine (embeddings, or an embedding model served on its own)."""
        workers_only = workers_only or self.embedding_only
        if self.probe_pending and self.components_ready:
            return ApiError(503, "the model is still loading (measuring its prefill speed)", error_type="server_error",
                            code="loading", headers={"Retry-After": "2"})
        never_ready = (workers_only or self.engine.state == "connecting") and \
            all(w.info is None and w.stuck_count == 0 for w in self.pool.workers.values())
        if never_ready:
            return ApiError(503, "the model is still loading", error_type="server_error", code="loading",
                            headers={"Retry-After": "5"})
        down = [name for name, w in self.pool.workers.items() if w.state != "ready"]
        engine_down = not workers_only and self.engine.state != "ready"
        down = (["decode engine"] if engine_down else []) + ([] if self.pool.num_ready else down)
        return ApiError(503, f"not available now ({', '.join(down)} restarting or unreachable); retry shortly",
                        error_type="server_error", code="unavailable", headers={"Retry-After": "2"})

    def load(self) -> tuple[int, int, int]:
        """(requests waiting for prefill or decode admission, KV blocks used, KV blocks total)."""
        stats = self.engine_stats
        waiting = self.registry.count(RequestStatus.WAITING) + self.registry.count(RequestStatus.PREFILLING)
        return waiting + stats.num_waiting, stats.kv_blocks_used, stats.kv_blocks_total

    @property
    def engine_stats(self) -> EngineStats:
        """The engine's last stats, or zeros while it is not connected."""
        return self.engine.stats or EMPTY_STATS

    def policy_signals(self, box: dict[str, float] | None = None) -> dict[str, float]:
        """This gateway's load signals, with the box's (CPU, memory: read now unless given, so that one tick reads
        them once: psutil's CPU figure is the use since its previous reading)."""
        waiting, used, total = self.load()
        return {"kv_cache_usage": used / total if total else 0.0, "waiting_requests": float(waiting),
                "prefill_queue": float(self.pool.queue_length), "ttft_p95_s": self.ttft_window.p95(),
                **(box_signals() if box is None else box), **self.slo.signals()}

    def update_policy_signals(self, others: tuple[Gateway, ...] = ()) -> None:
        """The tier evaluators fed the load. With `others` (the loaded models' gateways, issue 45), each model's
        evaluator is fed that model's own signals (its requests get its tier, edge speculates per its tier), and the
        box's evaluator gets, for each signal, the highest of any model's (the status page's tier: the most loaded
        model's)."""
        box = box_signals()
        signals = self.policy_signals(box)
        for other in others:
            own = other.policy_signals(box)
            self._count_transition(self.enforcer.update_signals(own, other.model_name), other)
            for name, value in own.items():
                worst = min if name == "slo_attainment_below" else max  # attainment: the lower, the worse
                signals[name] = worst(signals.get(name, value), value)
        if self.enforcer.tiers.per_model:
            self.enforcer.tiers.keep({other.model_name for other in others})
        self._count_transition(self.enforcer.update_signals(signals), self)
        for gateway in (self, *others):
            allowed = self.enforcer.speculation_allowed_for(gateway.model_name if gateway is not self else "")
            if allowed != gateway.engine.speculation:
                gateway.engine.speculation_changed(allowed)

    @staticmethod
    def _count_transition(transition, gateway: Gateway) -> None:
        if transition is not None:
            m = gateway.metrics
            m.label(m.tier_transitions, before=transition.before, after=transition.after).inc()

    async def next_event(self, run: Run) -> TokenEvent:
        """The next engine event for this run (edge.core.request_events); failures raise ApiError."""
        return await self.events.next_event(run)

    async def embeddings(self, run: Run, param: str = "input") -> EmbedDone:
        """The worker's answer to an embeddings (or rerank) request; failures raise ApiError."""
        return await self.events.embeddings(run, param)

    async def end(self, run: Run, status: RequestStatus, reason: str, usage: dict | None = None,
                  error: ApiError | None = None) -> None:
        """Record the one terminal state; stop any work still going on for the request. usage: OpenAI's usage
        object of what was produced; error: what the client was answered, if it failed."""
        inflight = run.inflight
        was = inflight.status
        if not inflight.advance(status):
            return
        if was == RequestStatus.PREFILLING and not inflight.num_prompt_tokens and inflight.needs_engine:
            self._abandoned_in_prefill(run)
        self._notify(ended_record(inflight, run.facts, status, reason, usage or {}, error))
        self.enforcer.release(run.decision)
        if status is not RequestStatus.FINISHED:
            if was <= RequestStatus.PREFILLING:
                await self.pool.cancel(inflight.request_id)
            await self.engine.abort(inflight.request_id)  # also covers a handoff still in flight
        self.registry.remove(inflight.request_id)
        m = self.metrics
        m.label(m.e2e).observe(time.perf_counter() - inflight.created)
        if status is RequestStatus.FAILED:
            m.label(m.failed).inc()
        if inflight.engine:  # it reached a worker, which was told its engine
            m.label(m.engine_requests, engine=inflight.engine).inc()
        m.label(m.finished, finished_reason=reason).inc()
        m.label(m.api_requests, route=run.route, status=status.name.lower()).inc()
        log.info("request %s (priority %d) %s (%s) after %.2f s; %s", inflight.request_id, inflight.priority,
                 status.name.lower(), reason, time.perf_counter() - inflight.created,
                 inflight.ttft_breakdown() or "no first token")

    def _abandoned_in_prefill(self, run: Run) -> None:
        """It ended while a worker was computing its prompt (the client went away, a failure): that prompt was
        worked on and counts (quotas, the record, /metrics) as a finished prefill's does. The worker reports the
        count only when it is done, so it is the prompt's own when sent as tokens, else the estimate from its text
        that the TTFT prediction uses (tokens per byte, learned from earlier prefills)."""
        tokens, _ = self.slo.predictor.estimate_tokens(run.request)
        run.inflight.num_prompt_tokens = max(1, round(tokens))
        self.metrics.label(self.metrics.prompt_tokens).inc(run.inflight.num_prompt_tokens)

    def rejected(self, http: web.Request, err: ApiError, request: GenerateRequest | None) -> None:
        """A request refused before it was queued (bad input, auth, policy, load): observers hear of it too."""
        tenant_header = self.enforcer.policy.tenant_header
        self._count_route(http, "rejected")
        self._notify(RequestRecord(
            time.time(), "", key_id(bearer_key(http)), "", http.headers.get(tenant_header) if tenant_header else None,
            request.model if request else "", request.kind if request else "", http.remote or "", "rejected",
            err.code or "", err.status, prompt_text=request.user_text if request else "", route=route_of(http)))

    def answered(self, http: web.Request, request: GenerateRequest, prompt_tokens: int, reason: str) -> None:
        """A request answered by the gateway without model work (count_tokens): observers hear of it too."""
        tenant_header = self.enforcer.policy.tenant_header
        self._count_route(http, "finished")
        self._notify(RequestRecord(
            time.time(), "", key_id(bearer_key(http)), "", http.headers.get(tenant_header) if tenant_header else None,
            request.model, request.kind, http.remote or "", "finished", reason, 200, prompt_tokens,
            prompt_text=request.user_text, route=route_of(http)))

    def _count_route(self, http: web.Request, status: str) -> None:
        self.metrics.label(self.metrics.api_requests, route=route_of(http), status=status).inc()

    def _notify(self, record: RequestRecord) -> None:
        for observer in self.observers:
            try:
                observer(record)
            except Exception:  # an observer's fault (a full disk for the audit log) must not fail the request
                log.exception("request observer %r failed", observer)

