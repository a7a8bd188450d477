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

from contracts.events import EngineStats
from contracts.messages import PrefillDone
from edge.api.openai_request import GenerateRequest
from edge.core import prefill_line
from edge.core.lifecycle import InFlight, RequestStatus
from edge.core.prefill_line import Line, Recorded
from edge.core.prefill_pool import PrefillPool

BYTES_PER_TOKEN = 4.0  # a prompt's text per token before any prefill was measured
OFFSET_HALF_LIFE_S = 30.0  # the learned offset fades without new first tokens (refusals bring none)
# a refusal judges the prediction plus the predictor's recent error at this quantile (its errors of the last
# ERROR_WINDOW_S at the request's priority, once MIN_ERRORS were measured): a request predicted just inside its
# objective would otherwise miss it about half the time
ERROR_QUANTILE = 0.9
ERROR_WINDOW_S = 60.0
MIN_ERRORS = 20
# the engine's stats come every 0.5 s: for this long after a request of ours that decoded ended, a running count in
# them with none of ours decoding is read as that request's, not as decoding of another gateway's: a warm burst right
# after its warm-up's answers ended was predicted beside decoding (twice the line) and admitted 3 where 6 fit
STATS_AGE_S = 1.0
SEED_TOKENS = (32, 256)  # a recorded line enters the fit as two prompts of these sizes
# a prefill beside CPU decoding, before one was measured: the worker gives decode half its threads
# (contracts/cpu_share.py), and both share the memory bandwidth
BESIDE_CPU_DECODE = 2.0
# a prefill beside decode that yields to it, taking at least this times the line alone, ran beside decoding after all
# (TTFTPredictor.ran_beside): between the line alone and BESIDE_CPU_DECODE's
BESIDE_EVIDENCE = 1.5
# a recorded line checked at start (edge.core.prefill_probe.check) is scaled by the check's ratio within these bounds:
# a few short prefills are never trusted alone, and real prefills move the line from the first one on
CHECK_RATIO = (0.5, 3.0)
# a check's prefill computes the prompt only (no chat template, no first token sampled, no KV exported: max_tokens 0),
# so it runs faster than a request's of its size: measured, 0.92x the line a quiet start of the same settings had
# recorded minutes before. Its ratio is read as this much of the box's.
CHECK_BIAS = 0.9
# until MIN_ERRORS first tokens were measured, a refusal judges the prediction plus this share of it (margin): on a
# fresh start's first burst, a line checked at 0.80x admitted 7, the 6th and 7th at 1.50 and 1.74 s
PRIOR_MARGIN = 0.1


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
    prefilled: bool = False  # its worker reported its prefill done (PrefillDone)
    tpot_predicted_ms: float | None = None  # the step ms predicted at admission (predict_tpot), if any
    choices: int = 1  # its n: with several, its decode yields to its level's prompts (yields_to)


def yields_to(decoding: Pending, priority: int) -> bool:
    """Whether a decoding request's steps yield to a prompt of this priority in prefill (the engine's PriorityGate,
    decode on the CPU): a less important request's do, and so do those of a request of the same priority whose class
    promises a first token and nothing per token (Sequence.decode_priority). The prefill then runs on every thread,
    at the line alone; the yields are bounded (max_hold_s, and for peers a duty of half), which the line beside
    decoding, learned from prefills that found decode still running, covers. A request with several choices and no
    TPOT objective yields to its own level's prompts too (decode_gpu's Sequence.decode_priority)."""
    return decoding.priority > priority or (decoding.priority == priority and not decoding.tpot_slo_ms
                                            and (decoding.ttft_slo_ms > 0 or decoding.choices > 1))


class PrefillTime:
    """Seconds one worker takes for a prompt, as a line over the tokens it computes: a fixed part (rendering,
    the first token's sampling, the KV export: most of a short prompt's time) and a part per token, fitted by
    least squares over recent prefills, each weighing `weight` more than the one before (a moving average). While
    the prompts measured are all of about one size, the line goes through zero (a rate)."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.sums = [0.0] * 5  # weighted count, tokens, seconds, tokens², tokens x seconds
        self.num_measured = 0  # real prefills added (a seeded line is none)

    def seed(self, line: Line) -> None:
        """Start from a recorded line, weighing as one prefill: two points on it, a short and a long prompt."""
        points = [(t, line.seconds(t)) for t in (SEED_TOKENS[0], SEED_TOKENS[1])]
        self.sums = [sum(0.5 * v for v in values) for values in zip(*((1.0, t, s, t * t, t * s) for t, s in points))]

    @property
    def measured(self) -> bool:
        return self.sums[0] > 0

    def add(self, tokens: float, seconds: float) -> None:
        keep = 1 - self.weight if self.measured else 0.0
        self.num_measured += 1
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

    def scale(self, factor: float) -> None:
        """Every prefill it was fitted on taken as `factor` times as long: the line's both parts scaled."""
        self.sums[2] *= factor
        self.sums[4] *= factor

    def seconds(self, tokens: float) -> float:
        fixed, per_token = self.line()
        return fixed + per_token * tokens

    def as_line(self) -> Line:
        return Line(*self.line())


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
    def __init__(self, pool: PrefillPool | None, clock=time.monotonic, threads: int | None = None,
                 cache_dir=None) -> None:
        self.pool, self.clock = pool, clock
        # one worker's seconds by prompt tokens computed (prompt-cache hits not): alone, and beside decoding (on a
        # CPU-only box decode takes half of a worker's threads while it has sequences)
        self.prefill, self.beside = PrefillTime(), PrefillTime()
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
        # the record of an earlier run with these settings (edge.core.prefill_line): read when the first worker is
        # ready, written while serving
        self.threads, self.cache_dir = threads, cache_dir
        self.settings: dict | None = None
        self.recorded_at: float | None = None  # when this run last wrote the record (clock)
        # when the last request of ours that decoded ended (clock): the engine's stats may still count it
        self.decoding_ended_at = -math.inf

    def estimate_tokens(self, request: GenerateRequest) -> tuple[float, int]:
        if request.prompt_tokens is not None:
            return float(len(request.prompt_tokens)), 0
        text_bytes = len(request.user_text.encode("utf-8", "surrogatepass"))
        return text_bytes * self.tokens_per_byte.value, text_bytes

    def predict(self, priority: int, deadline_at: float, tokens: float, pending: dict[str, Pending],
                engine: EngineStats | None = None) -> tuple[float, float, float] | None:
        """(predicted TTFT, the same without the learned offset, prompt tokens ahead) of a request about to be
        queued with this priority and deadline; None while no prefill line is known or no worker is ready.

        In the order the queue serves (priority, deadline, arrival), ahead of it: what is left of the prefills under
        way that it cannot preempt, the prompts queued at its rank or better, and those admitted but not queued yet
        (pending), shared by the ready workers; then its own. Every prefill after the first, and the first too when
        the engine decodes now, runs beside decoding (the requests ahead will decode by then), at that line, unless
        the decoding requests' steps yield to it (yields_to: a less important one, or a peer whose class promises a
        first token only), when it runs at the line alone."""
        ready = [w for w in self.pool.workers.values() if w.state == "ready" and w.engine_connected]
        if not ready:
            return None
        self._load_record(ready)
        if not self.prefill.measured:
            return None
        slowed = self._beside_factor(engine)
        decoding = [p for p in pending.values() if p.decoding]
        beside = any(not yields_to(p, priority) for p in decoding) or \
            (not decoding and engine is not None and engine.num_running > 0 and
             self.clock() - self.decoding_ended_at > STATS_AGE_S)
        rank = (priority, deadline_at or math.inf)
        ahead, ahead_s = 0.0, 0.0
        now = time.perf_counter()
        for worker in ready:
            if worker.current is None or worker.current.priority > priority:  # idle, or it would be preempted
                continue
            started = (self.pool.registry.get(worker.current.job.request_id) or InFlight("", 0)).prefill_started_at
            tokens_there = self._tokens_of(worker.current.job, pending)
            whole_s = self._seconds(tokens_there, beside, slowed)
            left_s = max(0.0, whole_s - (now - started)) if started is not None else whole_s
            ahead_s += left_s
            ahead += tokens_there * left_s / whole_s if whole_s > 0 else 0.0
            beside = beside or self._decodes_beside(worker.current.job.request_id, priority, pending)
        for request_id, n in self._queued_ahead(rank, pending):
            ahead, ahead_s = ahead + n, ahead_s + self._seconds(n, beside, slowed)
            beside = beside or self._decodes_beside(request_id, priority, pending)
        raw = ahead_s / len(ready) + self._seconds(tokens, beside, slowed) + (self.handoff_s.value or 0.0)
        return max(0.0, raw + self.offset(priority)), raw, ahead

    @staticmethod
    def _decodes_beside(request_id: str, priority: int, pending: dict[str, Pending]) -> bool:
        """Whether a request prefilled ahead decodes beside the prompts of this priority after it (its handoff decodes
        while they prefill), unless its steps yield to them (yields_to)."""
        known = pending.get(request_id)
        return known is None or not yields_to(known, priority)

    def _queued_ahead(self, rank: tuple[int, float], pending: dict[str, Pending]) -> list[tuple[str, float]]:
        """(request id, prompt tokens) of the jobs queued at this rank or better, and of the requests admitted at it
        that are neither queued nor at a worker yet (judged, about to be submitted), in the queue's order."""
        pool = self.pool
        queued = [((e.priority, e.deadline), e.job.request_id, self._tokens_of(e.job, pending)) for e in pool.queue
                  if (e.priority, e.deadline) <= rank]
        placed = {e.job.request_id for e in pool.queue} | {w.current_id for w in pool.workers.values() if w.current}
        for request_id, known in pending.items():
            if request_id in placed or known.prefilled or known.decoding:
                continue
            inflight = pool.registry.get(request_id)
            if inflight is not None and inflight.status is not RequestStatus.WAITING:
                continue
            key = (known.priority, known.deadline or math.inf)
            if key <= rank:
                queued.append((key, request_id, known.tokens))
        return [(request_id, n) for _, request_id, n in sorted(queued, key=lambda item: item[0])]

    def _beside_factor(self, engine: EngineStats | None) -> float:
        """How much slower a prefill runs beside decoding until one was measured so: BESIDE_CPU_DECODE with the
        engine on the CPU, 1 beside a GPU engine or one whose device its stats have not told yet."""
        memory = engine.memory if engine is not None else None
        return BESIDE_CPU_DECODE if memory is not None and memory.device == "cpu" else 1.0

    def _seconds(self, tokens: float, beside: bool = False, slowed: float = 1.0) -> float:
        computed = max(1.0, tokens - (self.cached_tokens.value or 0.0))
        if not beside:
            return self.prefill.seconds(computed)
        if self.beside.measured:
            return self.beside.seconds(computed)
        return slowed * self.prefill.seconds(computed)

    def offset(self, priority: int) -> float:
        known = self.offsets.get(priority)
        return known.now(self.clock()) if known is not None else 0.0

    @staticmethod
    def _tokens_of(job, pending: dict[str, Pending]) -> float:
        known = pending.get(job.request_id)
        if known is not None and job.resume_index < 0:
            return known.tokens
        return float(len(job.prompt_tokens or ()))  # a recompute carries its tokens

    def prefilled(self, done: PrefillDone, known: Pending | None, beside: bool = False) -> None:
        """A real prefill: its time (alone, or beside decoding), its handoff, and how many tokens its text made."""
        if done.prefill_ms > 0 and done.num_prompt_tokens:
            line = self.beside if beside else self.prefill
            line.add(done.num_prompt_tokens - done.cached_tokens, done.prefill_ms / 1e3)
            if done.cached_tokens <= done.num_prompt_tokens / 2:  # more: a preempted prefill resumed, or a repeat
                self.cached_tokens.add(done.cached_tokens)
        self.handoff_s.add(done.handoff_ms / 1e3)
        if known is not None and known.text_bytes and done.num_prompt_tokens:
            self.tokens_per_byte.add(done.num_prompt_tokens / known.text_bytes)
        self._record()

    def ran_beside(self, done: PrefillDone) -> bool:
        """Whether a prefill that found yielding decode beside it took so long that it ran beside decoding after all
        (the yield's duty ran out): at least BESIDE_EVIDENCE times the line alone's seconds for it, once that line is
        known. Learned as alone, a warm-up's 8 prompts at once put the line at 1.8x a 130-token prompt's real prefill,
        and the burst after it was admitted at 3 where 6 fit."""
        computed = done.num_prompt_tokens - done.cached_tokens
        if not self.prefill.measured or done.prefill_ms <= 0 or computed <= 0:
            return False
        return done.prefill_ms / 1e3 >= BESIDE_EVIDENCE * self.prefill.seconds(computed)

    def probed(self, done: PrefillDone) -> None:
        """A start-up probe's prefill (edge.core.prefill_probe: a fresh cache salt, nothing handed off): its time on
        the line alone, and nothing else, since its handoff, cache hits and text are no real request's."""
        if done.prefill_ms > 0 and done.num_prompt_tokens:
            self.prefill.add(done.num_prompt_tokens - done.cached_tokens, done.prefill_ms / 1e3)

    def check_record(self, done: list[PrefillDone]) -> float | None:
        """A recorded line checked by prefills at start: the median of (measured / the line's seconds) over them,
        over CHECK_BIAS and within CHECK_RATIO (the scale, returned), scales the line alone; the line beside decoding
        only upward (a box colder or busier than when it was recorded slows both; prefills alone that ran faster say
        nothing of decode's share of the cores, and a promise is better kept by a line too slow than too fast:
        measured, a 0.87x check run beside decoding at 1.0x the record). None, and nothing changed, without a line
        or a measured prefill."""
        if not self.prefill.measured:
            return None
        ratios = sorted(d.prefill_ms / 1e3 / self.prefill.seconds(d.num_prompt_tokens - d.cached_tokens)
                        for d in done if d.prefill_ms > 0 and d.num_prompt_tokens > d.cached_tokens)
        if not ratios:
            return None
        ratio = min(max(ratios[len(ratios) // 2] / CHECK_BIAS, CHECK_RATIO[0]), CHECK_RATIO[1])
        self.prefill.scale(ratio)
        if self.beside.measured and ratio > 1.0:
            self.beside.scale(ratio)
        return ratio

    def known(self) -> bool:
        """A prefill line is known: measured in this run, or recorded by an earlier one for the ready workers'
        settings (read now, once a ready worker said which model it serves)."""
        self._load_record([w for w in self.pool.workers.values() if w.state == "ready"])
        return self.prefill.measured

    def _settings(self, ready) -> dict | None:
        info = next((w.info for w in ready if w.info is not None), None)
        if info is None:
            return None
        return prefill_line.settings(info.model_fingerprint, info.prefill_weights, self.threads,
                                     len(self.pool.workers))

    def _load_record(self, ready) -> None:
        """Once a worker says which model it serves: start from the line recorded for these settings, if any."""
        if self.settings is not None:
            return
        self.settings = self._settings(ready)
        if self.settings is None or self.prefill.measured:
            return
        found = prefill_line.read(prefill_line.record_path(self.settings, self.cache_dir), self.settings)
        if found is None:
            return
        self.prefill.seed(found.alone)
        if found.beside is not None:
            self.beside.seed(found.beside)
        self.handoff_s.add(found.handoff_s)
        self.cached_tokens.add(found.cached_tokens)
        self.tokens_per_byte.value = found.tokens_per_byte

    def _record(self) -> None:
        """Write what this run measured, once MIN_RECORDED prefills ran alone, then at most every RECORD_EVERY_S (and
        when MIN_RECORDED ran beside decoding: their line is recorded from then on)."""
        if self.pool is None or self.prefill.num_measured < prefill_line.MIN_RECORDED:
            return
        now = self.clock()
        beside_known = self.beside.num_measured >= prefill_line.MIN_RECORDED
        first_beside = self.beside.num_measured == prefill_line.MIN_RECORDED  # new: recorded at once
        if self.recorded_at is not None and now - self.recorded_at < prefill_line.RECORD_EVERY_S and not first_beside:
            return
        if self.settings is None:
            self.settings = self._settings([w for w in self.pool.workers.values() if w.state == "ready"])
            if self.settings is None:
                return
        self.recorded_at = now
        found = Recorded(self.prefill.as_line(), self.beside.as_line() if beside_known else None,
                         self.handoff_s.value or 0.0, self.cached_tokens.value or 0.0, self.tokens_per_byte.value,
                         self.prefill.num_measured + self.beside.num_measured)
        prefill_line.write(prefill_line.record_path(self.settings, self.cache_dir), self.settings, found)

    def margin(self, priority: int, predicted_s: float = 0.0) -> float:
        """Seconds the predictions at this priority fell short by, at ERROR_QUANTILE of the last ERROR_WINDOW_S
        (0.0 when they were mostly early). A spike leaves the window within ERROR_WINDOW_S; a request with nothing
        ahead is never refused, so errors keep coming in meanwhile. Until MIN_ERRORS were measured there, PRIOR_MARGIN
        of the prediction (`predicted_s`): a line's error adds up over the prompts ahead, and a burst right after start
        is judged whole before any of its first tokens tells how far off it is."""
        ranked = recent_errors(self.errors.get(priority), self.clock())
        if not ranked:
            return PRIOR_MARGIN * predicted_s
        return max(0.0, ranked[int(ERROR_QUANTILE * (len(ranked) - 1))])

    def first_token(self, known: Pending, ttft_s: float) -> None:
        if known.raw_s is not None:
            now = self.clock()
            self.offsets.setdefault(known.priority, Offset(now)).learn(ttft_s - known.raw_s, now)
            self.errors.setdefault(known.priority, collections.deque()).append((now, ttft_s - known.predicted_s))
