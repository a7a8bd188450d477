"""How a handoff becomes a decoding request: checked against the model and the engine's limits, split into its
choices (n > 1), its first tokens reported, its KV bytes held in the backlog until imported, and then admitted
(engine thread) with a grammar matcher per choice when its output is structured. A recomputed handoff brings a
preempted choice back instead.

`open` runs on the asyncio side, so that the first tokens go out while a step runs: it reads no engine state
but the backlog (which locks) and the arrival counter. What needs the model's side (its identity, the seed a
choice samples with, grammar matchers) comes in as functions, which keeps this module free of torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from contracts.events import FinishReason, TokenEvent
from contracts.grammar import GrammarError
from contracts.handoff import KVHandoff, SamplingParams
from decode_gpu.core.detokenizer import IncrementalText
from decode_gpu.core.output import StopRules, logprobs_of, token_event
from decode_gpu.core.request_table import RequestTable
from decode_gpu.core.sequence import SeqState, Sequence


class HandoffRejectedError(ValueError):
    """A handoff the engine will not run (wrong model, too long for the pool or model, duplicate id, or no room
    now: then `code` is "engine_busy", which the gateway answers with 503 and Retry-After)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AdmissionLimits:
    max_num_seqs: int  # choices of one request decode together, so n may not exceed it
    max_model_len: int  # prompt + output tokens of one request
    capacity_tokens: int  # the KV pool's


@dataclass(frozen=True)
class ModelSide:
    """What admission asks of the model's side (torch), as functions."""
    check_model: Callable[[KVHandoff], None]  # raises ValueError when the handoff was made for another model
    seed_for: Callable[[SamplingParams, int], int]  # the int64 seed of choice `index`
    matcher_for: Callable[[Sequence], object]  # a grammar matcher that took the first token; ValueError if it can't


class Admission:
    def __init__(self, table: RequestTable, stops: StopRules, tokenizer, limits: AdmissionLimits,
                 model: ModelSide) -> None:
        self.table = table
        self.stops = stops
        self.tokenizer = tokenizer  # for each choice's incremental text (None: no text)
        self.limits = limits
        self.model = model
        self._arrivals = itertools.count()

    def add(self, handoff: KVHandoff) -> list[TokenEvent]:
        """Open and admit in one call (engine thread); a recomputed handoff resumes its choice and reports nothing."""
        if handoff.resume_index >= 0:
            self.resume(handoff)
            return []
        seq, events = self.open(handoff)
        if seq is not None:
            self.admit(seq)
        return events

    def open(self, handoff: KVHandoff) -> tuple[Sequence | None, list[TokenEvent]]:
        """Check a handoff and report each choice's first token. Runs on the asyncio thread while the engine thread
        steps, which is safe: of the engine's state it touches only the arrival counter (`next` on an
        itertools.count is atomic under the GIL) and the backlog (which reserves under its own lock). Returns the
        sequence for `admit` (the first choice that goes on; the others that do are its `forks`), or None when the
        first tokens already ended every choice (a stop token, or max_tokens 1). It holds the KV bytes in the
        backlog until imported; a full backlog refuses the handoff."""
        self._check_admissible(handoff)
        live, events = [], []
        for index, first in enumerate(handoff.first_tokens):
            seq = self._choice(handoff, index, first.token)
            reason, text = self.stops.finish_reason_and_text(seq)
            logprobs = logprobs_of(first.token, first.logprob, first.top_logprobs)
            events.append(token_event(seq, (first.token,), text, None, logprobs))
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

    def admit(self, seq: Sequence) -> None:
        """Start decoding an opened request: its sequence and the choices forked from it (engine thread)."""
        choices = [seq, *seq.forks]
        if seq.request_id in self.table.requests:
            self.table.release(seq)
            raise HandoffRejectedError(f"request id {seq.request_id} is already decoding")
        if seq.sampling.structured is not None:
            try:
                for choice in choices:
                    choice.meta["matcher"] = self.model.matcher_for(choice)
            except (GrammarError, ValueError) as err:
                self.table.release(seq)
                raise HandoffRejectedError(f"structured output: {err}") from None
        self.table.start(choices)

    def resume(self, handoff: KVHandoff) -> None:
        """The recomputed KV of a choice preempted by recompute: its prompt and output but the newest token, which it
        feeds next. The worker's first token is the one the engine sampled already (or a draw it does not need)."""
        choices = self.table.requests.get(handoff.request_id, [])
        seq = next((s for s in choices if s.index == handoff.resume_index), None)
        if seq is None or seq.state is not SeqState.RECOMPUTING:
            raise HandoffRejectedError(f"no choice {handoff.resume_index} of request {handoff.request_id} is waiting "
                                       f"for a recompute")
        if tuple(handoff.prompt_tokens) != tuple(seq.tokens[:-1]):
            raise HandoffRejectedError(f"the recompute of {seq.seq_id} holds {handoff.n_tokens} tokens that are not "
                                       f"its {len(seq.tokens) - 1} tokens before the newest")
        self._check_model(handoff)
        self._hold(seq, handoff)
        self.table.scheduler.resume(seq)

    def _choice(self, handoff: KVHandoff, index: int, first_token: int) -> Sequence:
        seq_id = handoff.request_id if index == 0 else f"{handoff.request_id}#{index}"
        seq = Sequence(seq_id=seq_id, priority=handoff.priority, arrival=next(self._arrivals),
                       prompt_len=handoff.n_tokens, tokens=[*handoff.prompt_tokens, first_token],
                       sampling=handoff.sampling, seed=self.model.seed_for(handoff.sampling, index),
                       request_id=handoff.request_id, index=index, deadline=handoff.deadline,
                       tpot_slo_ms=handoff.tpot_slo_ms, cache_salt=handoff.cache_salt)
        seq.meta["text"] = IncrementalText(self.tokenizer, handoff.sampling.stop)
        return seq

    def _hold(self, seq: Sequence, handoff: KVHandoff) -> None:
        """The sequence keeps its handoff until imported, its bytes counted in the backlog; a full backlog refuses
        it."""
        backlog = self.table.backlog
        if not backlog.can_reserve(handoff.payload_bytes):
            raise HandoffRejectedError(backlog.full_message(handoff.payload_bytes), code="engine_busy")
        backlog.reserve(handoff.payload_bytes)
        seq.handoff, seq.handoff_bytes = handoff, handoff.payload_bytes

    def _check_model(self, handoff: KVHandoff) -> None:
        try:
            self.model.check_model(handoff)
        except ValueError as err:
            raise HandoffRejectedError(str(err)) from None

    def _check_admissible(self, handoff: KVHandoff) -> None:
        self._check_model(handoff)
        n, most = handoff.sampling.n, self.limits.max_num_seqs
        if n > most:
            raise HandoffRejectedError(f"n = {n} choices, this engine decodes at most {most} sequences together "
                                       f"(max_num_seqs)")
        total = handoff.n_tokens + handoff.sampling.max_tokens
        limit = min(self.limits.capacity_tokens, self.limits.max_model_len)
        if total > limit:
            raise HandoffRejectedError(
                f"prompt ({handoff.n_tokens}) + max_tokens ({handoff.sampling.max_tokens}) = {total} tokens exceeds "
                f"the limit of {limit} (max_model_len {self.limits.max_model_len}, KV pool "
                f"{self.limits.capacity_tokens})")
