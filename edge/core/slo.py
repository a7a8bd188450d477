"""Scheduling to service-level objectives in the gateway: a request's TTFT deadline, the prediction of its time to
first token from the queue ahead of it, the early refusal of one that cannot meet its objective, and the accounting
of objectives met, missed and refused (Prometheus, the status page, the `slo_attainment_below` tier signal).

The prediction: the prefill time of the prompts queued ahead of the request at its priority and deadline (and what
is left of the prefills under way that it cannot preempt), shared by the ready workers, plus its own prompt's on one
worker, plus the handoff, plus an offset learned per priority. A prompt's prefill time is a fixed part and a part
per token (`PrefillTime`): a short prompt costs far more than its tokens at the rate of long ones. Every figure is a
moving average of real prefills while serving (PrefillDone), none a start-up benchmark; until one prefill was
measured nothing is predicted, so nothing is refused. A refusal judges the prediction plus the predictor's recent
shortfall at its 90th percentile (`TTFTPredictor.margin`), not the prediction alone: the objective is promised to
most requests, and one predicted just inside it misses about half the time. The error of each prediction is
measured at the first token and exported per class (`edge:slo_ttft_prediction_error_seconds`).

A request with a TPOT objective is also judged on the decode batch it would join (`predict_tpot`): the engine's step
times as measured while serving, at the number of sequences with objectives it would make, plus the median by which
the class's recent answers' TPOT ran from their predictions (`SloControl.tpot_error`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time

from prometheus_client import Counter, Gauge, Histogram

from contracts.events import EngineStats
from contracts.messages import PrefillDone
from edge.api.errors import policy_error
from edge.api.openai_request import ApiError, GenerateRequest
from edge.core.lifecycle import InFlight
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.core.request_record import RequestRecord
from edge.core.ttft_predictor import Pending, TTFTPredictor, recent_errors, yields_to
from policies.enforcer import Decision, PolicyEnforcer, PolicyRejection

log = logging.getLogger(__name__)
WINDOW_S = 60.0  # attainment and goodput are over this window
MIN_JUDGED = 5  # requests of a class judged in the window before its attainment is a tier signal
ERROR_BUCKETS = (-10, -5, -2.5, -1, -0.5, -0.25, -0.1, -0.05, 0, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# the TPOT check judges the predicted step time plus the median of (TPOT served - TPOT predicted) of the class's
# requests that ended in the last ERROR_WINDOW_S (once MIN_ERRORS did): the step of the batch a request joins is not
# its mean over its answer, as sequences end and the steps beside a prefill pass


def deadline(ttft_slo_ms: int, now: float | None = None) -> float:
    """The TTFT deadline a frame carries: epoch seconds of arrival + the objective; 0.0 without an objective."""
    return (time.time() if now is None else now) + ttft_slo_ms / 1e3 if ttft_slo_ms else 0.0


class SloMetrics:
    def __init__(self, metrics: Metrics) -> None:
        r, labels = metrics.registry, ["model_name", "class"]
        self.label = metrics.label
        self.requests = Counter("edge:slo_requests", "Requests judged against their class's objectives, by kind "
                                "(ttft, tpot) and outcome (met, missed, refused)", labels + ["kind", "outcome"],
                                registry=r)
        self.goodput = Gauge("edge:slo_goodput_requests_per_second", "Requests a second that met every objective "
                             "of their class (every finished one for a class without objectives), over 60 s",
                             labels, registry=r)
        self.attainment = Gauge("edge:slo_attainment", "Share of requests judged over 60 s that met every "
                                "objective of their class (refusals count as misses)", labels, registry=r)
        self.error = Histogram("edge:slo_ttft_prediction_error_seconds", "Measured TTFT minus the TTFT predicted at "
                               "admission", labels, buckets=ERROR_BUCKETS, registry=r)


class SloControl:
    """The gateway's objectives: Gateway calls judge, queued, prefilled and first_token; observe is one of its
    request observers."""

    def __init__(self, pool: PrefillPool, metrics: Metrics, clock=time.monotonic, threads: int | None = None) -> None:
        self.predictor = TTFTPredictor(pool, clock, threads)  # threads: each worker's (the prefill line's record)
        self.metrics = SloMetrics(metrics)
        self.clock = clock
        self.pending: dict[str, Pending] = {}  # request id -> what is known of it, from queued to its end
        # per class: (time, met every objective, judged against one) of each request that ended or was refused
        self.window: dict[str, collections.deque[tuple[float, bool, bool]]] = {}
        # per class: (time, TPOT served - TPOT predicted, ms) of requests that ended in the last ERROR_WINDOW_S
        self.tpot_errors: dict[str, collections.deque[tuple[float, float]]] = {}

    def judge(self, decision: Decision, request: GenerateRequest, priority: int, enforcer: PolicyEnforcer,
              engine: EngineStats | None = None) -> tuple[Decision, Pending]:
        """Predict this request's TTFT, and with a TPOT objective its time per output token from the engine's
        measured step times (`engine`, its last stats); a class that says so refuses it (ApiError 429
        slo_unattainable) or degrades it when a prediction exceeds its objective. Returns the decision to queue it
        with, and what `queued` remembers of it (its deadline for the frame)."""
        if request.kind == "embedding":  # no first token to promise: no objective
            decision = dataclasses.replace(decision, ttft_slo_ms=0, tpot_slo_ms=0, on_slo_miss="serve")
        tokens, text_bytes = self.predictor.estimate_tokens(request)
        due = deadline(decision.ttft_slo_ms)
        predicted = self.predictor.predict(priority, due, tokens, self.pending, engine)
        known = Pending(decision.client_class, decision.ttft_slo_ms, decision.tpot_slo_ms, tokens, text_bytes,
                        *(predicted[:2] if predicted else (None, None)), due, priority,
                        choices=request.sampling.n)
        # nothing ahead at its rank: the request would start at once, and a refusal could not make it any faster
        # (what is left is its own prompt and the noise of the offset)
        margin = self.predictor.margin(priority, predicted[0]) if predicted is not None and decision.ttft_slo_ms \
            else 0.0
        ttft_late = predicted is not None and decision.ttft_slo_ms and \
            (predicted[0] + margin) * 1e3 > decision.ttft_slo_ms and predicted[2] > 0
        tpot = predict_tpot(engine, self.pending) if decision.tpot_slo_ms else None
        tpot_error = self.tpot_error(decision.client_class) if tpot is not None else 0.0
        tpot_late = tpot is not None and tpot[0] + tpot_error > decision.tpot_slo_ms
        if tpot is not None:
            known.tpot_predicted_ms = tpot[0]
        if not (ttft_late or tpot_late) or decision.on_slo_miss == "serve":
            if predicted is not None:
                log.debug("admitted a request of class %r: TTFT predicted %.0f ms (%.0f ms + offset; %.0f tokens "
                          "ahead, its own %.0f; margin %.0f ms)", decision.client_class, predicted[0] * 1e3,
                          predicted[1] * 1e3, predicted[2], tokens, margin * 1e3)
            return decision, known
        if decision.on_slo_miss == "reject":
            self._refused(decision, "ttft" if ttft_late else "tpot")
            prior = not recent_errors(self.predictor.errors.get(priority), self.clock())
            refusal = unattainable(decision, predicted[0], predicted[2], margin, prior) if ttft_late else \
                tpot_unattainable(decision, *tpot, tpot_error)
            log.info("refused a request of class %r: %s", decision.client_class, refusal.message)
            raise refusal
        try:  # degrade
            return enforcer.degrade_for_slo(decision, request.sampling.n), known
        except PolicyRejection as err:  # the heavier tier sheds its class
            self._refused(decision, "ttft" if ttft_late else "tpot")
            raise policy_error(err) from None

    def queued(self, inflight: InFlight, known: Pending) -> None:
        self.pending[inflight.request_id] = known

    def deadline_of(self, request_id: str) -> float:
        """A queued request's deadline (a recompute of one of its choices keeps it); 0.0 when it has none."""
        known = self.pending.get(request_id)
        return known.deadline if known is not None else 0.0

    def prefilled(self, inflight: InFlight, done: PrefillDone) -> None:
        """A prefill's report: the predictor's line alone or beside decoding (another request of ours decoding as it
        ended whose steps do not yield to it, ttft_predictor.yields_to: on a CPU-only box decode then had half of the
        worker's threads; or whose steps yield, when the prefill took as long as one beside decoding: the yield is
        bounded, 2 s in any 4 s, so a burst's later prefills run beside decoding after all: ran_beside)."""
        known = self.pending.get(inflight.request_id)
        if known is not None:
            known.prefilled = True
        others = [p for rid, p in self.pending.items() if rid != inflight.request_id and p.decoding]
        beside = any(not yields_to(p, inflight.priority) for p in others)
        if not beside and others:  # they yield to it, but only so long (the gate's duty bound): did they here?
            beside = self.predictor.ran_beside(done)
        self.predictor.prefilled(done, None if done.resumed else known, beside)

    def probed(self, done: PrefillDone) -> None:
        """A prefill of the start-up probe (edge.core.prefill_probe): the predictor's line alone, no request's."""
        self.predictor.probed(done)

    def first_token(self, inflight: InFlight, ttft_s: float) -> None:
        known = self.pending.get(inflight.request_id)
        if known is None:
            return
        known.decoding = True
        if known.predicted_s is not None:
            self.metrics.label(self.metrics.error, **{"class": known.client_class}).observe(ttft_s - known.predicted_s)
            log.debug("%s: first token after %.0f ms, predicted %.0f ms", inflight.request_id, ttft_s * 1e3,
                      known.predicted_s * 1e3)
        self.predictor.first_token(known, ttft_s)

    def observe(self, record: RequestRecord) -> None:
        """A Gateway observer: an accepted request ended. A failure misses its objectives; a request the client
        left before its first token is not judged."""
        known = self.pending.pop(record.request_id, None)
        if known is None or record.status == "rejected":
            return
        if known.decoding:
            self.predictor.decoding_ended_at = self.clock()
        if record.status == "aborted" and record.ttft_s is None:
            return
        outcomes = {}
        if known.ttft_slo_ms:
            outcomes["ttft"] = record.ttft_s is not None and record.status != "failed" \
                and record.ttft_s * 1e3 <= known.ttft_slo_ms
        if known.tpot_slo_ms and (record.tpot_s is not None or record.status == "failed"):
            outcomes["tpot"] = record.tpot_s is not None and record.status != "failed" \
                and record.tpot_s * 1e3 <= known.tpot_slo_ms
        if known.tpot_predicted_ms is not None and record.tpot_s is not None and record.status == "finished":
            self.tpot_errors.setdefault(known.client_class, collections.deque()).append(
                (self.clock(), record.tpot_s * 1e3 - known.tpot_predicted_ms))
        for kind, met in outcomes.items():
            self.metrics.label(self.metrics.requests, **{"class": known.client_class}, kind=kind,
                               outcome="met" if met else "missed").inc()
        good = record.status == "finished" and all(outcomes.values())
        self._remember(known.client_class, good, bool(known.ttft_slo_ms or known.tpot_slo_ms))

    def tpot_error(self, client_class: str) -> float:
        """The median ms by which the class's served TPOT differed from its prediction, over the last ERROR_WINDOW_S
        (negative: served faster than predicted); 0.0 until MIN_ERRORS requests with a prediction ended there."""
        ranked = recent_errors(self.tpot_errors.get(client_class), self.clock())
        return ranked[len(ranked) // 2] if ranked else 0.0

    def _refused(self, decision: Decision, kind: str = "ttft") -> None:
        self.metrics.label(self.metrics.requests, **{"class": decision.client_class}, kind=kind,
                           outcome="refused").inc()
        self._remember(decision.client_class, False, True)

    def _remember(self, client_class: str, good: bool, judged: bool) -> None:
        self.window.setdefault(client_class, collections.deque(maxlen=100_000)).append((self.clock(), good, judged))

    def attainment(self) -> dict[str, dict]:
        """Per class over the window: requests judged against objectives, the share that met them (None when none
        was judged), and goodput (requests a second that met every objective). Also refreshes the gauges."""
        cutoff, out = self.clock() - WINDOW_S, {}
        for name, window in list(self.window.items()):
            while window and window[0][0] < cutoff:
                window.popleft()
            judged = [good for _, good, with_objective in window if with_objective]
            good = sum(1 for _, g, _ in window if g)
            out[name] = {"judged": len(judged), "attainment": round(sum(judged) / len(judged), 4) if judged else None,
                         "goodput_rps": round(good / WINDOW_S, 4)}
            self.metrics.label(self.metrics.goodput, **{"class": name}).set(good / WINDOW_S)
            if judged:
                self.metrics.label(self.metrics.attainment, **{"class": name}).set(sum(judged) / len(judged))
        return out

    def signals(self) -> dict[str, float]:
        """slo_attainment_below: the lowest attainment of a class judged at least MIN_JUDGED times in the window
        (absent otherwise, so a tier does not enter on too few requests)."""
        shares = [c["attainment"] for c in self.attainment().values()
                  if c["attainment"] is not None and c["judged"] >= MIN_JUDGED]
        return {"slo_attainment_below": min(shares)} if shares else {}


def predict_tpot(engine: EngineStats | None, pending: dict[str, Pending]) -> tuple[float, int] | None:
    """(step ms, sequences with a TPOT objective) of the decode batch a request with a TPOT objective would join:
    the engine's sequences with one, those accepted that have not reached it, and itself; their step time is the
    slowest measured at that many sequences or fewer (the batch also holds sequences without an objective, as many as
    the engine's cap lets in, so this is a floor). None when it would be the only one (a refusal makes nothing faster)
    or no such size was measured in the last 30 s."""
    if engine is None or not engine.step_ms:
        return None
    others = engine.tpot_sequences + sum(1 for p in pending.values() if p.tpot_slo_ms and not p.decoding)
    rows = others + 1
    known = [ms for size, ms in engine.step_ms.items() if size <= rows]
    if not others or not known:
        return None
    return max(known), rows


def tpot_unattainable(decision: Decision, step_ms: float, rows: int, error_ms: float = 0.0) -> ApiError:
    """429 slo_unattainable for the time per output token: the batch changes within seconds, so Retry-After is 1."""
    served = f"; served answers' TPOT ran {error_ms:+.0f} ms from their predictions (median)" if error_ms else ""
    return ApiError(429, f"the time per output token predicted now is {step_ms:.0f} ms (a decode step of {rows} "
                         f"sequences with objectives, as measured{served}), more than the {decision.tpot_slo_ms} ms "
                         f"promised to class {decision.client_class!r}; retry after 1 s", code="slo_unattainable",
                    error_type="rate_limit_error", headers={"Retry-After": "1"})


def unattainable(decision: Decision, predicted_s: float, ahead: float, margin_s: float = 0.0,
                 prior: bool = False) -> ApiError:
    """429 slo_unattainable, at once: Retry-After is how much later the same prediction would meet the objective
    (what the queue ahead needs to drain). prior: the margin is the fresh start's share of the prediction
    (TTFTPredictor.margin), not a measured shortfall."""
    promised = decision.ttft_slo_ms
    retry_after = max(1, math.ceil(predicted_s + margin_s - promised / 1e3))
    error = "" if margin_s <= 0 else \
        f"; with a margin of {margin_s * 1e3:.0f} ms until first tokens measured the predictions" if prior else \
        f"; one in ten recent predictions fell short by {margin_s * 1e3:.0f} ms or more"
    return ApiError(429, f"the time to first token predicted now is {predicted_s * 1e3:.0f} ms ({ahead:.0f} prompt "
                         f"tokens ahead{error}), more than the {promised} ms promised to class "
                         f"{decision.client_class!r}; retry after {retry_after} s", code="slo_unattainable",
                    error_type="rate_limit_error", headers={"Retry-After": str(retry_after)})
