"""The decode engine: ingests handoffs, steps the scheduler and model runner, emits token events and stats.

This file is the step loop that joins the parts: admission turns handoffs into requests (core/admission), the
request table is where choices and requests end (core/request_table), the stop rules decide when and what text
a choice releases (core/output), and the step sampler draws every row of a step at once (sample/step_sampler).
One thread owns all of it (the engine thread, decode_gpu.service.engine_loop); only `open` may run elsewhere.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from contracts.events import EngineStats, TokenEvent
from contracts.handoff import KVHandoff
from decode_gpu.core.admission import Admission, AdmissionLimits, HandoffRejectedError, ModelSide
from decode_gpu.core.backlog import DEFAULT_LIMIT_BYTES, Backlog
from decode_gpu.core.block_manager import BlockManager
from decode_gpu.core.output import StopRules, take_tokens
from decode_gpu.core.prefill_yield import yield_to_prefill
from decode_gpu.core.request_table import RequestTable
from decode_gpu.core.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from decode_gpu.core.sequence import SeqState, Sequence
from decode_gpu.core.speculative import SpecConfig, Speculator, StepCosts, accepted_length
from decode_gpu.core.throughput import Throughput
from decode_gpu.kv.importer import check_handoff_matches
from decode_gpu.kv.kv_return import MIN_RETURN_TOKENS, FinishedKV, KVReturn, copy_out
from decode_gpu.model.weight_quant import held_weight_dtype, weight_bytes
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from decode_gpu.sample.grammar_matchers import GrammarMatchers
from decode_gpu.sample.step_sampler import StepSampler
from sampling.sampler import SampledRow
from sampling.sampling_params import resolve_seed

__all__ = ["DecodeEngine", "EngineConfig", "HandoffRejectedError"]  # the error is admission's, raised through here
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    runner: RunnerConfig = RunnerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    max_model_len: int = 4096  # prompt + output tokens of one request
    max_backlog_bytes: int = DEFAULT_LIMIT_BYTES  # KV bytes of handoffs accepted but not yet imported
    swap_space_bytes: int = 4 << 30  # host memory for preempted sequences' KV blocks
    speculative: SpecConfig = SpecConfig()  # n-gram speculative decoding (off by default)


def _cost_record(runner, config: EngineConfig):
    """Where this engine's start-up cost model is recorded by a quiet start: beside the model's converted weights
    (None for a model without a GGUF file, e.g. tests' and benchmarks' synthetic ones)."""
    identity = runner.identity
    if not os.path.isfile(identity.path):
        return None
    from contracts.cache import converted_dir
    key = runner.cost_record_key(config.scheduler.max_num_seqs, config.speculative.num_speculative_tokens)
    return converted_dir(identity) / "step_costs" / f"{key}.json"


class DecodeEngine:
    def __init__(self, runner: ModelRunner, config: EngineConfig = EngineConfig(), tokenizer=None,
                 eos_token_ids: tuple[int, ...] = (), step_costs: StepCosts | None = None) -> None:
        """step_costs: speculative decoding's cost model, if already measured for this runner's model and device
        (otherwise the runner measures it here, when speculation is configured)."""
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        shape = runner.pool.shape
        self.blocks = BlockManager(runner.num_blocks, shape.block_size)
        self.scheduler = Scheduler(config.scheduler, self.blocks,
                                   max_swap_blocks=config.swap_space_bytes // shape.bytes_per_block())
        # a step beside a prompt in prefill (the runner's PriorityGate, on a CPU) is no sample of the curve's shape
        self.scheduler.beside_prefill = lambda: getattr(getattr(self.runner, "gate", None), "prefill_active", False)
        self.backlog = Backlog(config.max_backlog_bytes)  # reserved by open (any thread), released here
        self.table = RequestTable(self.scheduler, self.backlog, runner.forget)
        self.requests = self.table.requests  # request id -> its choices still decoding (n > 1: several)
        self.stops = StopRules(frozenset(eos_token_ids), config.max_model_len)
        matchers = GrammarMatchers(tokenizer, runner, tuple(self.stops.eos_token_ids))
        limits = AdmissionLimits(config.scheduler.max_num_seqs, config.max_model_len,
                                 self.blocks.num_blocks * self.blocks.block_size)
        model_side = ModelSide(lambda handoff: check_handoff_matches(handoff, runner.identity), resolve_seed,
                               matchers.matcher)
        self.admission = Admission(self.table, self.stops, tokenizer, limits, model_side)
        self.sampler = StepSampler(self.stops, matchers)
        spec = config.speculative
        if spec.enabled and spec.planned and step_costs is None:  # probed (or reused), before any request
            step_costs = runner.step_costs(config.scheduler.max_num_seqs, spec.num_speculative_tokens,
                                           record=_cost_record(runner, config))
        self.speculator = Speculator(spec, step_costs)
        # sequences preempted by recompute whose tokens the engine's owner must have prefilled again (it drains this)
        self.recompute_requests: list[Sequence] = []
        self._throughput = Throughput()
        # finished sequences' KV goes back to the prefill worker that prefilled them (set by the engine service; None:
        # nothing is returned); the sequences that ended normally in this step, with their block tables
        self.kv_return: KVReturn | None = None
        self._finished_kv: list[tuple[Sequence, list[int]]] = []
        model = getattr(runner, "model", None)  # (test runners may have none)
        self._weights = (held_weight_dtype(model), weight_bytes(model)) if model is not None else ("", {})

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def sequences(self) -> list[Sequence]:
        """Every choice still decoding, of every request."""
        return self.table.sequences

    @property
    def best_running_priority(self) -> int | None:
        """The best (lowest) priority among the sequences that decode, None when none does."""
        return min((s.priority for s in self.sequences if s.state is SeqState.RUNNING), default=None)

    # --- requests in and out (Admission and RequestTable say how) ------------------------------------
    def add(self, handoff: KVHandoff) -> list[TokenEvent]:
        """Accept a handoff; its first tokens (sampled by the prefill worker) are reported at once. A recomputed
        one (resume_index >= 0) brings a preempted choice back and reports nothing."""
        return self.admission.add(handoff)

    def open(self, handoff: KVHandoff) -> tuple[Sequence | None, list[TokenEvent]]:
        """Check a handoff and report its first tokens without touching the engine's state (any thread)."""
        return self.admission.open(handoff)

    def admit(self, seq: Sequence) -> None:
        """Start decoding an opened request (engine thread)."""
        self.admission.admit(seq)

    def resume(self, handoff: KVHandoff) -> None:
        """Take back the recomputed KV of a choice preempted by recompute (engine thread)."""
        self.admission.resume(handoff)

    def abort(self, request_id: str, error: str | None = None) -> TokenEvent | None:
        return self.table.abort(request_id, error)

    def fail_all(self, why: str) -> list[TokenEvent]:
        return self.table.fail_all(why)

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        started = time.perf_counter()
        step = yield_to_prefill(self.scheduler.schedule(), getattr(self.runner, "gate", None))
        events = [self.table.fail(seq, why) for seq, why in step.failed]
        try:
            num_decoded = self._run(step, events)
        except Exception as err:  # the batched forward (or a device fault): no one sequence to blame
            log.exception("decode step failed")
            self._finished_kv.clear()  # their blocks may be anyone's by the next step's end
            return events + self.fail_all(f"decode step failed: {err}")
        self._throughput.record(num_decoded, time.perf_counter() - started)
        self._return_finished()
        return events

    def _return_finished(self) -> None:
        """Copy the blocks of the sequences that ended normally this step out of the pool, before a later step may
        write them, for the KV return's thread to encode. Only choice 0 of a request (n > 1: the one answer a
        conversation goes on from), only stop or length endings (an abort or error is no prefix of anything)."""
        finished, self._finished_kv = self._finished_kv, []
        if self.kv_return is None:
            return
        for seq, table in finished:
            origin = seq.meta.get("kv_return")
            n = min(seq.num_cached, len(seq.tokens) - 1)  # the last token was sampled, never fed
            if origin is None or seq.index != 0 or n < MIN_RETURN_TOKENS:
                continue
            blocks = table[:self.blocks.blocks_for(n)]
            shape = self.runner.pool.shape
            if not self.kv_return.can_offer(len(blocks) * shape.bytes_per_block()):
                self.kv_return.count_dropped()
                continue
            saved, ready = copy_out(self.runner.pool, blocks)
            self.kv_return.offer(FinishedKV(seq.request_id, origin[0], origin[1], tuple(seq.tokens[:n]),
                                            seq.tokens[n], seq.cache_salt, saved, shape, ready))

    def _run(self, step: ScheduledStep, events: list[TokenEvent]) -> int:
        """Memory moves, then one forward, then batched sampling; appends to events as it goes, so that a
        failure part-way loses no event already made. Returns the tokens generated."""
        self.recompute_requests.extend(step.recompute)
        # seq id -> draft tokens, their KV slots reserved before the memory moves (which make any copy-on-write)
        drafts = self.speculator.plan(step.decode, self.blocks, self.config.max_model_len, step.copies)
        failures = self.runner.prepare(step)  # [(seq id, why)]: this sequence's own move failed
        for seq, _ in step.imports:
            if seq.handoff is not None:  # what its returned KV is encoded as: the handoff's own types and rotations
                seq.meta["kv_return"] = (seq.handoff.model_fingerprint, seq.handoff.layout)
            self.table.drop_handoff(seq)  # its KV is in the pool (or failed to get there): free the bytes now
        events.extend(self.table.fail_each(failures))
        decode = [seq for seq in step.decode if seq.state is SeqState.RUNNING]
        if not decode:
            return 0
        fed = [drafts.get(seq.seq_id, []) for seq in decode]  # [] for a sequence without a draft this step
        started = time.perf_counter()
        if any(fed):
            logits = self.runner.verify(decode, self.blocks.block_tables, fed)  # [sum(1 + len(draft)), vocab]
        else:
            logits = self.runner.forward(decode, self.blocks.block_tables)  # [len(decode), vocab]
        # row (seq, ahead) samples the position after seq's tokens and `ahead`, the draft tokens before it taken
        # as accepted
        rows = iter(self.sampler.sample([(seq, draft[:j]) for seq, draft in zip(decode, fed)
                                         for j in range(1 + len(draft))], logits))
        # the forward and its sampling (which reads the logits back: on CUDA, the step's end) as speculation's live
        # cost model sees it
        self.speculator.observe(any(fed), len(decode) + sum(map(len, fed)), len(decode),
                                (time.perf_counter() - started) * 1e3)
        first = len(events)
        for seq, draft in zip(decode, fed):
            events.append(self._emit(seq, draft, [next(rows) for _ in range(1 + len(draft))]))
        return sum(len(event.token_ids) for event in events[first:])

    def _emit(self, seq: Sequence, draft: list[int], rows: list[SampledRow]) -> TokenEvent:
        """One sequence's new tokens: the draft tokens its own draws confirm, then one draw more. A failure here
        (bad logits, a sampler error) fails this sequence only."""
        num_accepted = accepted_length(draft, [-1 if row.problem else row.token for row in rows])
        if draft:
            self.speculator.record(seq, len(draft), num_accepted)
        try:
            tokens, text, reason, logprobs = take_tokens(seq, rows[:num_accepted + 1], self.stops)
            table = list(self.blocks.block_tables.get(seq.seq_id, ())) if reason else []  # freed by the ending
            event = self.table.tokens_event(seq, tokens, text, reason, logprobs)
            if reason in ("stop", "length"):
                self._finished_kv.append((seq, table))
            return event
        except Exception as err:
            log.exception("sampling failed for request %s", seq.seq_id)
            return self.table.fail(seq, f"sampling failed: {err}")

    # --- settings and stats --------------------------------------------------------------------
    def set_speculation(self, enabled: bool) -> None:
        """Speculate from the next step on, or not; on only when configured (EngineConfig.speculative)."""
        self.speculator.enabled = enabled and self.config.speculative.enabled

    def stats(self) -> EngineStats:
        swapped = sum(1 for s in self.sequences if s.state is SeqState.SWAPPED)
        spec = self.speculator.counters
        gate = getattr(self.runner, "gate", None)  # the runner's PriorityGate, if it has one (test runners may not)
        return EngineStats(
            kv_blocks_used=self.blocks.num_used_blocks, kv_blocks_total=self.blocks.num_blocks,
            kv_capacity_tokens=self.blocks.num_blocks * self.blocks.block_size,
            num_waiting=self.scheduler.num_waiting, num_running=self.scheduler.num_running, num_swapped=swapped,
            num_preemptions=self.scheduler.num_preemptions, last_step_ms=self._throughput.last_step_ms,
            tokens_per_s=self._throughput.tokens_per_s, generated_tokens=self._throughput.generated,
            decode_yielded_s=gate.waited_s if gate else 0.0,
            backlog_bytes=self.backlog.num_bytes, backlog_limit_bytes=self.backlog.limit_bytes,
            weight_dtype=self._weights[0], weight_bytes=self._weights[1],
            num_spec_drafts=spec.num_drafts, num_spec_draft_tokens=spec.num_draft_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens, spec_accepted_per_pos=tuple(spec.accepted_per_pos),
            prefix_cache_queries=self.blocks.num_cache_queries * self.blocks.block_size,
            prefix_cache_hits=self.blocks.num_cache_hits * self.blocks.block_size,
            step_ms=self.scheduler.step_times.recent_ms(self.scheduler.clock()),
            tpot_sequences=self.scheduler.num_tpot_sequences)
