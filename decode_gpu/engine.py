"""The decode engine: ingests handoffs, steps the scheduler and model runner, emits token events and stats."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from decode_gpu.core.backlog import DEFAULT_LIMIT_BYTES, Backlog
from decode_gpu.core.block_manager import BlockManager
from decode_gpu.core.detokenizer import IncrementalText
from decode_gpu.kv.importer import check_handoff_matches
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from decode_gpu.sample.sampler import SampledRow, sample_rows
from decode_gpu.sample.sampling_params import SamplingBatch, SamplingRow, resolve_seed
from decode_gpu.core.scheduler import OUT_OF_KV, ScheduledStep, Scheduler, SchedulerConfig
from decode_gpu.core.sequence import SeqState, Sequence
from decode_gpu.core.speculative import SpecConfig, Speculator, StepCosts, accepted_length
from decode_gpu.sample.structured import Grammars
from decode_gpu.model.weight_quant import held_weight_dtype, weight_bytes
from contracts.grammar import GrammarError
from contracts.events import EngineStats, FinishReason, Logprob, TokenEvent, TopLogprob
from contracts.handoff import KVHandoff

log = logging.getLogger(__name__)


class HandoffRejectedError(ValueError):
    """A handoff the engine will not run (wrong model, too long for the pool or model, duplicate id, or no room
    now: then `code` is "engine_busy", which the gateway answers with 503 and Retry-After)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class EngineConfig:
    runner: RunnerConfig = RunnerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    max_model_len: int = 4096  # prompt + output tokens of one request
    max_backlog_bytes: int = DEFAULT_LIMIT_BYTES  # KV bytes of handoffs accepted but not yet imported
    swap_space_bytes: int = 4 << 30  # host memory for preempted sequences' KV blocks
    speculative: SpecConfig = SpecConfig()  # n-gram speculative decoding (off by default)


@dataclass
class _Throughput:
    tokens_per_s: float = 0.0
    last_step_ms: float = 0.0
    generated: int = 0
    started: float = field(default_factory=time.perf_counter)

    def record(self, n_tokens: int, seconds: float) -> None:
        self.generated += n_tokens
        self.last_step_ms = seconds * 1e3
        rate = n_tokens / seconds if seconds > 0 else 0.0
        self.tokens_per_s = rate if self.tokens_per_s == 0 else 0.8 * self.tokens_per_s + 0.2 * rate


class DecodeEngine:
    def __init__(self, runner: ModelRunner, config: EngineConfig = EngineConfig(), tokenizer=None,
                 eos_token_ids: tuple[int, ...] = (), step_costs: StepCosts | None = None) -> None:
        """step_costs: speculative decoding's cost model, if already measured for this runner's model and device
        (otherwise the runner measures it here, when speculation is configured)."""
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        shape = runner.pool.shape
        self.blocks = BlockManager(runner.num_blocks, shape.block_size)
        self.scheduler = Scheduler(config.scheduler, self.blocks,
                                   max_swap_blocks=config.swap_space_bytes // shape.bytes_per_block())
        self.backlog = Backlog(config.max_backlog_bytes)  # reserved by open (any thread), released here
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its choices still decoding (n > 1: several)
        self._arrivals = itertools.count()
        self._throughput = _Throughput()
        self._grammars: Grammars | None = None  # built on the first structured request
        spec = config.speculative
        if spec.enabled and spec.planned and step_costs is None:  # measured once, before any request
            step_costs = runner.step_costs(config.scheduler.max_num_seqs, spec.num_speculative_tokens)
        self.speculator = Speculator(spec, step_costs)
        # sequences preempted by recompute whose tokens the engine's owner must have prefilled again (it drains this)
        self.recompute_requests: list[Sequence] = []
        model = getattr(runner, "model", None)  # (test runners may have none)
        self._weights = (held_weight_dtype(model), weight_bytes(model)) if model is not None else ("", {})

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def sequences(self) -> list[Sequence]:
        """Every choice still decoding, of every request."""
        return [seq for seqs in self.requests.values() for seq in seqs]

    @property
    def best_running_priority(self) -> int | None:
        """The best (lowest) priority among the sequences that decode, None when none does."""
        return min((s.priority for s in self.sequences if s.state is SeqState.RUNNING), default=None)

    def add(self, handoff: KVHandoff) -> list[TokenEvent]:
        """Accept a handoff; its first tokens (sampled by the prefill worker) are reported at once. A recomputed
        one (resume_index >= 0) brings a preempted choice back and reports nothing."""
        if handoff.resume_index >= 0:
            self.resume(handoff)
            return []
        seq, events = self.open(handoff)
        if seq is not None:
            self.admit(seq)
        return events

    def open(self, handoff: KVHandoff) -> tuple[Sequence | None, list[TokenEvent]]:
        """Check a handoff and report each choice's first token, without touching the engine's state, so the
        engine server can send the first tokens while a step runs. Returns the sequence for `admit` (the first
        choice that goes on; the others that do are its `forks`), or None when the first tokens already ended
        every choice (a stop token, or max_tokens 1). It holds the KV bytes in the backlog until imported; a
        full backlog refuses the handoff."""
        self._check_admissible(handoff)
        live, events = [], []
        for index, first in enumerate(handoff.first_tokens):
            seq = self._choice(handoff, index, first.token)
            logprobs = ()
            if first.logprob is not None:
                logprobs = (Logprob(first.token, first.logprob,
                                    top=tuple(TopLogprob(token_id, logprob) for token_id, logprob in first.top_logprobs)),)
            reason, text = self._finish_reason_and_text(seq)
            events.append(self._event(seq, (first.token,), text, None, logprobs))
            if reason is None:
                live.append(seq)
            else:
                events[-1] = dataclasses.replace(events[-1], choice_finish=FinishReason(reason))
        if not live:  # the last choice's end is the request's
            events[-1] = dataclasses.replace(events[-1], finish_reason=events[-1].choice_finish, choice_finish=None)
            return None, events
        root, root.forks = live[0], live[1:]
        self._hold(root, handoff)
        return root, events

    def _hold(self, seq: Sequence, handoff: KVHandoff) -> None:
        """The sequence keeps its handoff until imported, its bytes counted in the backlog; a full backlog refuses it."""
        if not self.backlog.can_reserve(handoff.payload_bytes):
            raise HandoffRejectedError(self.backlog.full_message(handoff.payload_bytes), code="engine_busy")
        self.backlog.reserve(handoff.payload_bytes)
        seq.handoff, seq.handoff_bytes = handoff, handoff.payload_bytes

    def resume(self, handoff: KVHandoff) -> None:
        """The recomputed KV of a choice preempted by recompute: its prompt and output but the newest token, which it
        feeds next. The worker's first token is the one the engine sampled already (or a draw it does not need)."""
        seq = next((s for s in self.requests.get(handoff.request_id, []) if s.index == handoff.resume_index), None)
        if seq is None or seq.state is not SeqState.RECOMPUTING:
            raise HandoffRejectedError(f"no choice {handoff.resume_index} of request {handoff.request_id} is waiting "
                                       f"for a recompute")
        if tuple(handoff.prompt_tokens) != tuple(seq.tokens[:-1]):
            raise HandoffRejectedError(f"the recompute of {seq.seq_id} holds {handoff.n_tokens} tokens that are not "
                                       f"its {len(seq.tokens) - 1} tokens before the newest")
        self._check_model(handoff)
        self._hold(seq, handoff)
        self.scheduler.resume(seq)

    def _choice(self, handoff: KVHandoff, index: int, first_token: int) -> Sequence:
        seq_id = handoff.request_id if index == 0 else f"{handoff.request_id}#{index}"
        seq = Sequence(seq_id=seq_id, priority=handoff.priority, arrival=next(self._arrivals),
                       prompt_len=handoff.n_tokens, tokens=[*handoff.prompt_tokens, first_token],
                       sampling=handoff.sampling, seed=resolve_seed(handoff.sampling, index),
                       request_id=handoff.request_id, index=index)
        seq.meta["text"] = IncrementalText(self.tokenizer, handoff.sampling.stop)
        return seq

    def admit(self, seq: Sequence) -> None:
        """Start decoding an opened request: its sequence and the choices forked from it (engine thread)."""
        choices = [seq, *seq.forks]
        if seq.request_id in self.requests:
            self._release(seq)
            raise HandoffRejectedError(f"request id {seq.request_id} is already decoding")
        if seq.sampling.structured is not None:
            try:
                for choice in choices:
                    choice.meta["matcher"] = self._matcher(choice)
            except (GrammarError, ValueError) as err:
                self._release(seq)
                raise HandoffRejectedError(f"structured output: {err}") from None
        self.requests[seq.request_id] = choices
        self.scheduler.add(seq)

    def _matcher(self, seq: Sequence):
        """The sequence's grammar matcher, having taken the first token (which the prefill worker masked)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer to build token masks with")
            self._grammars = Grammars(self.tokenizer, self.runner.model.config.vocab_size, tuple(self.eos_token_ids))
        matcher = self._grammars.matcher(*seq.sampling.structured)
        if not matcher.accept_token(seq.tokens[-1]):
            raise ValueError(f"the first token {seq.tokens[-1]} does not fit the constraint")
        return matcher

    def abort(self, request_id: str, error: str | None = None) -> TokenEvent | None:
        """End a request (every choice) at any stage; with `error`, it ends as failed, saying why."""
        choices = self.requests.pop(request_id, None)
        if not choices:
            return None
        for seq in choices:
            self.scheduler.abort(seq.seq_id)
            self._release(seq)
        return self._event(choices[0], (), "", "abort" if error is None else "error", error=error)

    def fail_all(self, why: str) -> list[TokenEvent]:
        """End every request as failed (a failure no single sequence explains); the engine stays usable."""
        return [self.abort(request_id, error=why) for request_id in list(self.requests)]

    def step(self) -> list[TokenEvent]:
        started = time.perf_counter()
        step = self._yielding(self.scheduler.schedule())
        events = [self._fail(seq, why) for seq, why in step.failed]
        try:
            num_decoded = self._run(step, events)
        except Exception as err:  # the batched forward (or a device fault): no one sequence to blame
            log.exception("decode step failed")
            return events + self.fail_all(f"decode step failed: {err}")
        self._throughput.record(num_decoded, time.perf_counter() - started)
        return events

    def _run(self, step: ScheduledStep, events: list[TokenEvent]) -> int:
        """Memory moves, then one forward, then batched sampling; appends to events as it goes, so that a
        failure part-way loses no event already made. Returns the tokens generated."""
        # seq id -> draft tokens, their KV slots reserved before the memory moves (which make any copy-on-write)
        self.recompute_requests.extend(step.recompute)
        drafts = self.speculator.plan(step.decode, self.blocks, self.config.max_model_len, step.copies)
        failures = self.runner.prepare(step)  # [(seq id, why)]: this sequence's own move failed
        for seq, _ in step.imports:
            self._drop_handoff(seq)  # its KV is in the pool (or failed to get there): free the bytes now
        if failures:
            by_id = {seq.seq_id: seq for seq in self.sequences}
            events.extend(self._fail(by_id[seq_id], why) for seq_id, why in failures
                          if seq_id in by_id and by_id[seq_id].state is not SeqState.FINISHED)
        decode = [seq for seq in step.decode if seq.state is SeqState.RUNNING]
        if not decode:
            return 0
        fed = [drafts.get(seq.seq_id, []) for seq in decode]  # [] for a sequence without a draft this step
        if any(fed):
            logits = self.runner.verify(decode, self.blocks.block_tables, fed)  # [sum(1 + len(draft)), vocab]
        else:
            logits = self.runner.forward(decode, self.blocks.block_tables)  # [len(decode), vocab]
        # row (seq, ahead) samples the position after seq's tokens and `ahead`, the draft tokens before it taken
        # as accepted
        rows = iter(self._sampled([(seq, draft[:j]) for seq, draft in zip(decode, fed) for j in range(1 + len(draft))],
                                  logits))
        first = len(events)
        for seq, draft in zip(decode, fed):
            events.append(self._sample(seq, draft, [next(rows) for _ in range(1 + len(draft))]))
        return sum(len(event.token_ids) for event in events[first:])

    def _sampled(self, rows: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> list[SampledRow]:
        """Every row's token with one device-to-host copy. Bad logits are flagged per row; should the batched
        sampler raise instead, each row is sampled alone, so that only the rows at fault fail."""
        try:
            return sample_rows(logits, self._sampling_batch(rows, logits.device))
        except Exception:
            log.exception("batched sampling failed; sampling each row alone")
            return [self._sampled_alone(row, logits_row) for row, logits_row in zip(rows, logits)]

    def _sampled_alone(self, row: tuple[Sequence, list[int]], logits: torch.Tensor) -> SampledRow:  # logits: [vocab]
        """One row through the sampler by itself: an error here becomes this row's problem."""
        try:
            return sample_rows(logits[None], self._sampling_batch([row], logits.device))[0]
        except Exception as err:
            return SampledRow(-1, str(err) or type(err).__name__)

    def _sampling_batch(self, rows: list[tuple[Sequence, list[int]]], device: torch.device) -> SamplingBatch:
        # the position of the token being sampled keys its noise: the same seed and prompt give the same
        # tokens in any batch, after preemption, and with or without speculation
        batch = SamplingBatch.build([self._sampling_row(seq, ahead) for seq, ahead in rows], device)
        matchers = [seq.meta.get("matcher") for seq, _ in rows]  # a structured sequence never has a draft
        if any(m is not None for m in matchers):
            batch = dataclasses.replace(batch, token_mask=self._grammars.bitmask(matchers, device))
        return batch

    def _sampling_row(self, seq: Sequence, ahead: list[int]) -> SamplingRow:
        """The draw after seq's tokens and then `ahead`: what the step would sample there were they accepted."""
        position = len(seq.tokens) + len(ahead)
        row = SamplingRow(seq.sampling, seq.seed, position, seq.tokens, seq.prompt_len, self._banned(seq, position))
        # penalties count the draft tokens ahead as context (the tokens are read only by penalized rows)
        return dataclasses.replace(row, tokens=[*seq.tokens, *ahead]) if ahead and row.penalized else row

    def _banned(self, seq: Sequence, position: int) -> tuple[int, ...]:
        """Before min_tokens are out, the tokens that would end the request may not be drawn."""
        params = seq.sampling
        if position - seq.prompt_len >= params.min_tokens:
            return ()
        return tuple({*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)})

    def _sample(self, seq: Sequence, draft: list[int], rows: list[SampledRow]) -> TokenEvent:
        """One sequence's new tokens: the draft tokens its own draws confirm, then one draw more. A failure here
        (bad logits, a sampler error) fails this sequence only."""
        num_accepted = accepted_length(draft, [-1 if row.problem else row.token for row in rows])
        if draft:
            self.speculator.record(seq, len(draft), num_accepted)
        start, texts, logprobs, reason = len(seq.tokens), [], [], None
        try:
            for row in rows[:num_accepted + 1]:
                reason = self._take(seq, row, texts, logprobs)
                if reason is not None:
                    break  # draft tokens past a stop are dropped
            return self._after_tokens(seq, tuple(seq.tokens[start:]), "".join(texts), reason, tuple(logprobs))
        except Exception as err:
            log.exception("sampling failed for request %s", seq.seq_id)
            return self._fail(seq, f"sampling failed: {err}")

    def _take(self, seq: Sequence, row: SampledRow, texts: list[str], logprobs: list[Logprob]) -> str | None:
        """Append one sampled token (the one before it is now in the pool); returns why it ends the request."""
        seq.num_cached += 1
        if row.problem is not None:
            raise FloatingPointError(row.problem)
        seq.tokens.append(row.token)
        matcher = seq.meta.get("matcher")
        if matcher is not None and not matcher.accept_token(row.token):
            raise ValueError(f"token {row.token} is outside the structured output's grammar")
        logprobs.extend(self._logprobs(row))
        reason, text = self._finish_reason_and_text(seq)
        texts.append(text)
        return reason

    def _yielding(self, step: ScheduledStep) -> ScheduledStep:
        """While a more important prompt is in prefill (CPU boxes), the sequences it outranks sit this step
        out, keeping their blocks; if it outranks all of them, the forward itself waits between layers."""
        gate = self._gate
        if gate is None:
            return step
        urgent = [seq for seq in step.decode if not gate.outranks(seq.priority)]
        if not urgent or len(urgent) == len(step.decode):
            return step
        return dataclasses.replace(step, decode=urgent)

    def set_speculation(self, enabled: bool) -> None:
        """Speculate from the next step on, or not; on only when configured (EngineConfig.speculative)."""
        self.speculator.enabled = enabled and self.config.speculative.enabled

    def stats(self) -> EngineStats:
        swapped = sum(1 for s in self.sequences if s.state is SeqState.SWAPPED)
        spec = self.speculator.counters
        return EngineStats(
            kv_blocks_used=self.blocks.num_used_blocks, kv_blocks_total=self.blocks.num_blocks,
            kv_capacity_tokens=self.blocks.num_blocks * self.blocks.block_size,
            num_waiting=self.scheduler.num_waiting, num_running=self.scheduler.num_running, num_swapped=swapped,
            num_preemptions=self.scheduler.num_preemptions, last_step_ms=self._throughput.last_step_ms,
            tokens_per_s=self._throughput.tokens_per_s, generated_tokens=self._throughput.generated,
            decode_yielded_s=self._gate.waited_s if self._gate else 0.0,
            backlog_bytes=self.backlog.num_bytes, backlog_limit_bytes=self.backlog.limit_bytes,
            weight_dtype=self._weights[0], weight_bytes=self._weights[1],
            num_spec_drafts=spec.num_drafts, num_spec_draft_tokens=spec.num_draft_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens, spec_accepted_per_pos=tuple(spec.accepted_per_pos),
            prefix_cache_queries=self.blocks.num_cache_queries * self.blocks.block_size,
            prefix_cache_hits=self.blocks.num_cache_hits * self.blocks.block_size)

    @property
    def _gate(self):
        """The runner's PriorityGate, if it has one (test runners may not)."""
        return getattr(self.runner, "gate", None)

    def _check_model(self, handoff: KVHandoff) -> None:
        try:
            check_handoff_matches(handoff, self.runner.identity)
        except ValueError as err:
            raise HandoffRejectedError(str(err)) from None

    def _check_admissible(self, handoff: KVHandoff) -> None:
        self._check_model(handoff)
        n, most = handoff.sampling.n, self.config.scheduler.max_num_seqs
        if n > most:
            raise HandoffRejectedError(f"n = {n} choices, this engine decodes at most {most} sequences together "
                                       f"(max_num_seqs)")
        total = handoff.n_tokens + handoff.sampling.max_tokens
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if total > min(capacity, self.config.max_model_len):
            raise HandoffRejectedError(
                f"prompt ({handoff.n_tokens}) + max_tokens ({handoff.sampling.max_tokens}) = {total} tokens exceeds "
                f"the limit of {min(capacity, self.config.max_model_len)} (max_model_len "
                f"{self.config.max_model_len}, KV pool {capacity})")

    def _after_tokens(self, seq: Sequence, tokens: tuple, text: str, reason: str | None,
                      logprobs: tuple) -> TokenEvent:
        if reason is None:
            return self._event(seq, tokens, text, None, logprobs)
        self.scheduler.finish(seq, reason)
        choices = self.requests.get(seq.request_id, [])
        choices[:] = [choice for choice in choices if choice is not seq]
        if choices:  # other choices go on: this one's end is not the request's
            event = self._event(seq, tokens, text, None, logprobs)
            return dataclasses.replace(event, choice_finish=FinishReason(reason))
        self.requests.pop(seq.request_id, None)
        return self._event(seq, tokens, text, reason, logprobs)

    def _finish_reason_and_text(self, seq: Sequence) -> tuple[str | None, str]:
        """Whether the newest token ends the request, and the text it releases."""
        token = seq.tokens[-1]
        params = seq.sampling
        text_state: IncrementalText = seq.meta["text"]
        reason = None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif seq.meta.get("matcher") is not None and seq.meta["matcher"].is_terminated():
            reason = "stop"  # the grammar is complete (its end token was taken)
        elif len(seq.output_tokens) >= params.max_tokens or len(seq.tokens) >= self.config.max_model_len:
            reason = "length"
        eos = reason == "stop"
        text = text_state.update(seq.output_tokens[:-1] if eos else seq.output_tokens, final=reason is not None)
        if text_state.stopped:
            reason = "stop"
        return reason, text

    def _fail(self, seq: Sequence, why: str) -> TokenEvent:
        """End a request as failed for one sequence's fault (with n > 1 its other choices end too: the client gets
        all of them or an error), freeing blocks, swap space and handoff bytes."""
        for choice in {id(s): s for s in (seq, *self.requests.pop(seq.request_id, ()))}.values():
            if choice.state is not SeqState.FINISHED:
                self.scheduler.finish(choice, "error")
            self._release(choice)
        log.error("request %s failed in decode: %s", seq.seq_id, why)
        event = self._event(seq, (), "", "error", error=why)
        # running out of KV memory is load, not a fault: the gateway answers it like a full queue
        return dataclasses.replace(event, error_code="kv_cache_full") if why.startswith(OUT_OF_KV) else event

    def _release(self, seq: Sequence) -> None:
        self._drop_handoff(seq)
        self.runner.forget(seq.seq_id)

    def _drop_handoff(self, seq: Sequence) -> None:
        seq.handoff = None
        if seq.handoff_bytes:
            self.backlog.release(seq.handoff_bytes)
            seq.handoff_bytes = 0

    def _event(self, seq: Sequence, tokens: tuple, text: str, reason: str | None, logprobs: tuple = (),
               error: str | None = None) -> TokenEvent:
        reason = FinishReason(reason) if reason is not None else None
        return TokenEvent(seq.request_id, tokens, text, reason, error, logprobs, seq.prompt_len,
                          len(seq.output_tokens), index=seq.index)

    @staticmethod
    def _logprobs(row: SampledRow) -> tuple:
        if row.logprob is None:
            return ()
        return (Logprob(row.token, row.logprob, top=tuple(TopLogprob(i, v) for i, v in row.top)),)
