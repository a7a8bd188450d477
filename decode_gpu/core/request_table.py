"""The requests that decode, and the one place where their choices end.

A request is the list of its choices still decoding (n > 1: several). Whatever ends a choice (its stop rules, a
fault of its own, an abort, a failed batch) ends it here, so that it leaves the scheduler, gives back its
handoff's backlog bytes and its runner state exactly once, and the client hears of it in exactly one event.
Engine thread only; no torch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from contracts.events import FinishReason, TokenEvent
from decode_gpu.core.backlog import Backlog
from decode_gpu.core.output import token_event
from decode_gpu.core.scheduler import OUT_OF_KV, Scheduler
from decode_gpu.core.sequence import SeqState, Sequence

log = logging.getLogger(__name__)


class RequestTable:
    def __init__(self, scheduler: Scheduler, backlog: Backlog, forget: Callable[[str], None]) -> None:
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its choices still decoding
        self.scheduler = scheduler
        self.backlog = backlog
        self.forget = forget  # by seq id: the runner drops what it keeps for a sequence (its swapped KV)

    @property
    def sequences(self) -> list[Sequence]:
        """Every choice still decoding, of every request."""
        return [seq for seqs in self.requests.values() for seq in seqs]

    def start(self, choices: list[Sequence]) -> None:
        """The first choice goes to the scheduler; the others are its forks, which follow it into the pool."""
        self.requests[choices[0].request_id] = choices
        self.scheduler.add(choices[0])

    def tokens_event(self, seq: Sequence, tokens: tuple, text: str, reason: str | None,
                     logprobs: tuple) -> TokenEvent:
        """The event of a choice's new tokens; a reason ends the choice, and the request with its last choice."""
        if reason is None:
            return token_event(seq, tokens, text, None, logprobs)
        self.scheduler.finish(seq, reason)
        choices = self.requests.get(seq.request_id, [])
        choices[:] = [choice for choice in choices if choice is not seq]
        if choices:  # other choices go on: this one's end is not the request's
            event = token_event(seq, tokens, text, None, logprobs)
            return dataclasses.replace(event, choice_finish=FinishReason(reason))
        self.requests.pop(seq.request_id, None)
        return token_event(seq, tokens, text, reason, logprobs)

    def fail(self, seq: Sequence, why: str) -> TokenEvent:
        """End a request as failed for one sequence's fault (with n > 1 its other choices end too: the client gets
        all of them or an error), freeing blocks, swap space and handoff bytes."""
        for choice in {id(s): s for s in (seq, *self.requests.pop(seq.request_id, ()))}.values():
            if choice.state is not SeqState.FINISHED:
                self.scheduler.finish(choice, "error")
            self.release(choice)
        log.error("request %s failed in decode: %s", seq.seq_id, why)
        event = token_event(seq, (), "", "error", error=why)
        # running out of KV memory is load, not a fault: the gateway answers it like a full queue
        return dataclasses.replace(event, error_code="kv_cache_full") if why.startswith(OUT_OF_KV) else event

    def fail_each(self, failures: list[tuple[str, str]]) -> list[TokenEvent]:
        """Fail the sequences named by seq id, each for its own reason (a memory move of its own failed); one
        that ended already, or whose request another failure ended, is passed over."""
        if not failures:
            return []
        by_id = {seq.seq_id: seq for seq in self.sequences}
        return [self.fail(by_id[seq_id], why) for seq_id, why in failures
                if seq_id in by_id and by_id[seq_id].state is not SeqState.FINISHED]

    def abort(self, request_id: str, error: str | None = None) -> TokenEvent | None:
        """End a request (every choice) at any stage; with `error`, it ends as failed, saying why. None: it is not
        decoding (it ended on its own meanwhile)."""
        choices = self.requests.pop(request_id, None)
        if not choices:
            return None
        for seq in choices:
            self.scheduler.abort(seq.seq_id)
            self.release(seq)
        return token_event(choices[0], (), "", "abort" if error is None else "error", error=error)

    def fail_all(self, why: str) -> list[TokenEvent]:
        """End every request as failed (a failure no single sequence explains); the engine stays usable."""
        return [self.abort(request_id, error=why) for request_id in list(self.requests)]

    def release(self, seq: Sequence) -> None:
        self.drop_handoff(seq)
        self.forget(seq.seq_id)

    def drop_handoff(self, seq: Sequence) -> None:
        """Its KV is in the pool (or will never get there): the handoff's bytes leave the backlog now."""
        seq.handoff = None
        if seq.handoff_bytes:
            self.backlog.release(seq.handoff_bytes)
            seq.handoff_bytes = 0
