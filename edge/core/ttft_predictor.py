"""The time to first token a request would see if queued now, predicted from the prompts ahead of it in the prefill
queue (edge.core.slo says how it is used). A prompt's prefill time is a fixed part and a part per token
(`PrefillTime`), fitted on real prefills while serving (PrefillDone); what the model misses is learned per priority
as an offset (`Offset`) from the first tokens, and its recent shortfall (`TTFTPredictor.margin`) is what a refusal
adds to a prediction."""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

from contracts.messages import PrefillDone
from edge.api.openai_request import GenerateRequest
from edge.core.lifecycle import InFlight
from edge.core.prefill_pool import PrefillPool

BYTES_PER_TOKEN = 4.0  # a prompt's text per token before any prefill was measured
OFFSET_HALF_LIFE_S = 30.0  # the learned offset fades without new first tokens (refusals bring none)
# a refusal judges the prediction plus the predictor's recent error at this quantile (its errors of the last
# ERROR_WINDOW_S at the request's priority, once MIN_ERRORS were measured): a request predicted just inside its
# objective would otherwise miss it about half the time
ERROR_QUANTILE = 0.9
ERROR_WINDOW_S = 60.0
MIN_ERRORS = 20


def recent_errors(errors: collections.deque[tuple[float, float]] | None, now: float) -> list[float]:
    """A window of (when, error) without what is older than ERROR_WINDOW_S (dropped from it), sorted; empty while
    fewer than MIN_ERRORS remain."""
    if not errors:
        return []
    while errors and errors[0][0] < now - ERROR_WINDOW_S:
        errors.popleft()
    return sorted(error for _, error in errors) if len(errors) >= MIN_ERRORS else []


class Ewma:
    """A moving average; None until the first sample."""

    def __init__(self, weight: float = 0.2, value: float | None = None) -> None:
        self.weight, self.value = weight, value

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


@dataclass
class Pending:
    """What the gateway knows of an accepted request until it ends."""
    client_class: str
    ttft_slo_ms: int
    tpot_slo_ms: int
    tokens: float  # its prompt's tokens: exact when sent as tokens, else estimated from the text's bytes
    text_bytes: int  # 0: sent as tokens
    predicted_s: float | None  # the TTFT predicted at admission; None: nothing measured yet
    raw_s: float | None  # the prediction without the learned offset
    deadline: float  # epoch seconds (PrefillJob.deadline); 0.0: no TTFT objective
    priority: int = 0
    decoding: bool = False  # its first token came: the engine's stats count it
    tpot_predicted_ms: float | None = None  # the step ms predicted at admission (predict_tpot), if any


class PrefillTime:
    """Seconds one worker takes for a prompt, as a line over the tokens it computes: a fixed part (rendering,
    the first token's sampling, the KV export: most of a short prompt's time) and a part per token, fitted by
    least squares over recent prefills, each weighing `weight` more than the one before (a moving average). While
    the prompts measured are all of about one size, the line goes through zero (a rate)."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.sums = [0.0] * 5  # weighted count, tokens, seconds, tokens², tokens x seconds

    @property
    def measured(self) -> bool:
        return self.sums[0] > 0

    def add(self, tokens: float, seconds: float) -> None:
        keep = 1 - self.weight if self.measured else 0.0
        self.sums = [keep * old + new for old, new in zip(self.sums, (1.0, tokens, seconds, tokens ** 2,
                                                                      tokens * seconds))]

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token)."""
        n, t, s, tt, ts = self.sums
        mean_t, mean_s = t / n, s / n
        spread = tt / n - mean_t ** 2
        if spread > (0.25 * mean_t) ** 2:  # sizes differ enough to tell the fixed part from the rest
            per_token = (ts / n - mean_t * mean_s) / spread
            fixed = mean_s - per_token * mean_t
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, mean_s / max(mean_t, 1.0)

    def seconds(self, tokens: float) -> float:
        fixed, per_token = self.line()
        return fixed + per_token * tokens


class Offset:
    """What the model misses (dispatch, a preemption's cancel, the engine's first token), learned per priority
    from first tokens; it fades by half every OFFSET_HALF_LIFE_S without one: a spike that made it refuse
    everything would otherwise never be unlearned, since refusals measure nothing."""

    def __init__(self, now: float) -> None:
        self.value, self.at = Ewma(value=0.0), now

    def now(self, now: float) -> float:
        return self.value.value * 0.5 ** ((now - self.at) / OFFSET_HALF_LIFE_S)

    def learn(self, error_s: float, now: float) -> None:
        self.value.value = self.now(now)
        self.value.add(error_s)
        self.at = now


class TTFTPredictor:
    def __init__(self, pool: PrefillPool, clock=time.monotonic) -> None:
        self.pool, self.clock = pool, clock
        self.prefill = PrefillTime()  # one worker's seconds by prompt tokens computed (prompt-cache hits not)
        # prompt tokens a fresh prompt finds in the worker's prompt cache (a shared prefix: the chat template's)
        self.cached_tokens = Ewma()
        self.handoff_s = Ewma()
        # per priority: a request's first token also waits on what ranks above it and arrives after it (never
        # predicted, so each level learns its own), while the same offset for all would carry the lowest level's
        # waits into the best one's predictions
        self.offsets: dict[int, Offset] = {}
        self.tokens_per_byte = Ewma(value=1 / BYTES_PER_TOKEN)
        # per priority: (when, first token's TTFT - its prediction) of the last ERROR_WINDOW_S
        self.errors: dict[int, collections.deque[tuple[float, float]]] = {}

    def estimate_tokens(self, request: GenerateRequest) -> tuple[float, int]:
        if request.prompt_tokens is not None:
            return float(len(request.prompt_tokens)), 0
        text_bytes = len(request.user_text.encode("utf-8", "surrogatepass"))
        return text_bytes * self.tokens_per_byte.value, text_bytes

    def predict(self, priority: int, deadline_at: float, tokens: float, pending: dict[str, Pending]
                ) -> tuple[float, float, float] | None:
        """(predicted TTFT, the same without the learned offset, prompt tokens ahead) of a request about to be
        queued with this priority and deadline; None while no prefill was measured or no worker is ready."""
        ready = [w for w in self.pool.workers.values() if w.state == "ready" and w.engine_connected]
        if not self.prefill.measured or not ready:
            return None
        rank = (priority, deadline_at or math.inf)
        queued = [self._tokens_of(e.job, pending) for e in self.pool.queue if (e.priority, e.deadline) <= rank]
        ahead, ahead_s = sum(queued), sum(self._seconds(n) for n in queued)
        now = time.perf_counter()
        for worker in ready:
            if worker.current is None or worker.current.priority > priority:  # idle, or it would be preempted
                continue
            started = (self.pool.registry.get(worker.current.job.request_id) or InFlight("", 0)).prefill_started_at
            tokens_there = self._tokens_of(worker.current.job, pending)
            whole_s = self._seconds(tokens_there)
            left_s = max(0.0, whole_s - (now - started)) if started is not None else whole_s
            ahead_s += left_s
            ahead += tokens_there * left_s / whole_s if whole_s > 0 else 0.0
        raw = ahead_s / len(ready) + self._seconds(tokens) + (self.handoff_s.value or 0.0)
        return max(0.0, raw + self.offset(priority)), raw, ahead

    def _seconds(self, tokens: float) -> float:
        return self.prefill.seconds(max(1.0, tokens - (self.cached_tokens.value or 0.0)))

    def offset(self, priority: int) -> float:
        known = self.offsets.get(priority)
        return known.now(self.clock()) if known is not None else 0.0

    @staticmethod
    def _tokens_of(job, pending: dict[str, Pending]) -> float:
        known = pending.get(job.request_id)
        if known is not None and job.resume_index < 0:
            return known.tokens
        return float(len(job.prompt_tokens or ()))  # a recompute carries its tokens

    def prefilled(self, done: PrefillDone, known: Pending | None) -> None:
        """A real prefill: its time, its handoff, and how many tokens its text made."""
        if done.prefill_ms > 0 and done.num_prompt_tokens:
            self.prefill.add(done.num_prompt_tokens - done.cached_tokens, done.prefill_ms / 1e3)
            if done.cached_tokens <= done.num_prompt_tokens / 2:  # more: a preempted prefill resumed, or a repeat
                self.cached_tokens.add(done.cached_tokens)
        self.handoff_s.add(done.handoff_ms / 1e3)
        if known is not None and known.text_bytes and done.num_prompt_tokens:
            self.tokens_per_byte.add(done.num_prompt_tokens / known.text_bytes)

    def margin(self, priority: int) -> float:
        """Seconds the predictions at this priority fell short by, at ERROR_QUANTILE of the last ERROR_WINDOW_S
        (0.0 when they were mostly early, or fewer than MIN_ERRORS were measured). A spike leaves the window
        within ERROR_WINDOW_S; a request with nothing ahead is never refused, so errors keep coming in meanwhile."""
        ranked = recent_errors(self.errors.get(priority), self.clock())
        return max(0.0, ranked[int(ERROR_QUANTILE * (len(ranked) - 1))]) if ranked else 0.0

    def first_token(self, known: Pending, ttft_s: float) -> None:
        if known.raw_s is not None:
            now = self.clock()
            self.offsets.setdefault(known.priority, Offset(now)).learn(ttft_s - known.raw_s, now)
            self.errors.setdefault(known.priority, collections.deque()).append((now, ttft_s - known.predicted_s))
