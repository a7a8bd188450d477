"""The engine thread's side of the engine process: the one owner of the engine's state.

It applies the asyncio side's commands between two steps, steps while there is work, and hands back what it
made through the loop (call_soon_threadsafe): token events, and the sequences preempted by recompute that the
gateway must have prefilled again. Other threads read only `snapshot`, the stats it publishes after each round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable

from contracts.cpu_share import CpuShare
from contracts.events import EngineStats, FinishReason, TokenEvent
from contracts.messages import Recompute
from decode_gpu.core.admission import HandoffRejectedError
from decode_gpu.core.priority_gate import PriorityGate
from decode_gpu.core.sequence import SeqState
from decode_gpu.engine import DecodeEngine
from decode_gpu.service.commands import AbortRequest, Admit, Command, Resume, SetSpeculation
from decode_gpu.service.memory import MemoryAccount, decisions, trim_heap

log = logging.getLogger("decode_gpu.service.server")
MEMORY_EVERY_S = 0.5  # the memory components are read again at most this often (the stats go out every 0.5 s)


class EngineLoop:
    def __init__(self, engine: DecodeEngine, loop: asyncio.AbstractEventLoop, stopping: threading.Event,
                 send_events: Callable[[list[TokenEvent]], None], send_recomputes: Callable[[list[Recompute]], None],
                 gate: PriorityGate, cpu_share: CpuShare | None = None, pace_s: float = 0.0,
                 account: MemoryAccount | None = None) -> None:
        self.engine = engine
        self.loop = loop
        self.stopping = stopping
        self.send_events = send_events  # on the loop
        self.send_recomputes = send_recomputes  # on the loop
        self.gate = gate
        self.cpu_share = cpu_share  # decode on the CPU: tells local prefill workers when it is decoding
        # decode on the CPU next to prefill workers: while prompts wait for a busy worker, a step starts at most
        # every pace_s (0: no pacing), so decode takes less of the cores and batches more sequences a step
        self.pace_s = pace_s
        self._step_started = 0.0
        # Commands in arrival order. An Admit's handoff bytes are held in the engine's backlog (full: the handoff
        # is refused before it gets here); a Resume's only once applied. AbortRequest and SetSpeculation are a few
        # bytes each, at most one per control frame read, and all of them are applied between two steps.
        self.inbox: queue.Queue[Command] = queue.Queue()
        self.account = account  # the memory by component and the decisions go out with the stats when set
        self._memory, self._memory_at = None, float("-inf")
        self.snapshot = self._stats()  # published here; other threads never read engine state

    def run(self) -> None:
        while not self.stopping.is_set():
            self._drain_inbox(block=not self.engine.has_work)
            if self.pace_s and self.engine.has_work:
                self._pace()
            if self.engine.has_work:
                self._step()
                if not self.engine.has_work:  # a burst ended: its freed activations go back to the system
                    trim_heap()
            if self.cpu_share is not None:
                self.cpu_share.set_decoding(self._decode_level())
            self.snapshot = self._stats()
        self._drain_inbox(block=False)  # opened sequences still in the inbox end with the rest
        self._publish([self.engine.abort(request_id) for request_id in list(self.engine.requests)])
        if self.cpu_share is not None:
            self.cpu_share.set_decoding(None)

    def _decode_level(self) -> int | None:
        """The level local prefill workers share the cores by (contracts/cpu_share.py): the best decode priority
        among the running sequences, rounded down the scale (a choice yielding to its own priority's prompts,
        Sequence.decode_priority, counts at the next level: a prompt of its priority gets every thread)."""
        levels = [s.decode_priority for s in self.engine.sequences if s.state is SeqState.RUNNING]
        return math.ceil(min(levels)) if levels else None

    def _stats(self) -> EngineStats:
        """The engine's stats, with its memory (read again every MEMORY_EVERY_S) and decisions when accounted."""
        stats = self.engine.stats()
        if self.account is None:
            return stats
        now = time.monotonic()
        if now - self._memory_at >= MEMORY_EVERY_S:
            self._memory, self._memory_at = self.account.memory(), now
        return dataclasses.replace(stats, memory=self._memory, decisions=decisions(self.engine))

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:  # the engine fails a sequence, or a whole batch, itself; this is the last line
            events = self.engine.step()
        except Exception as err:
            log.exception("decode step failed")
            events = self.engine.fail_all(f"decode step failed: {err}")
        self._publish(events)
        self._ask_for_recomputes()

    def _pace(self) -> None:
        """While prompts wait for a busy prefill worker on these cores, hold the next step until pace_s after the
        last one began, serving the inbox meanwhile (aborts end at once); the wait ends as soon as the backlog does."""
        while not self.stopping.is_set() and self.gate.backlog:
            left = self._step_started + self.pace_s - time.monotonic()
            if left <= 0:
                return
            self._drain_inbox(block=True, timeout_s=left)

    def _drain_inbox(self, block: bool, timeout_s: float = 0.1) -> None:
        try:
            command = self.inbox.get(timeout=timeout_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._publish(self._apply(command))
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: Command) -> list[TokenEvent]:
        """The one place a command meets the engine; returns the events it made."""
        match command:
            case Admit(seq):
                try:
                    self.engine.admit(seq)
                except HandoffRejectedError as err:
                    return [TokenEvent.ending(seq.request_id, FinishReason.ERROR, str(err), seq.prompt_len, err.code)]
            case Resume(handoff):  # one that does not fit ends its request
                try:
                    self.engine.resume(handoff)
                except HandoffRejectedError as err:
                    why = f"recomputing a preempted request failed: {err}"
                    return self._apply(AbortRequest(handoff.request_id, why))
            case AbortRequest(request_id, error):
                event = self.engine.abort(request_id, error)
                return [] if event is None else [event]  # None: it ended on its own in the meantime
            case SetSpeculation(enabled):
                self.engine.set_speculation(enabled)
        return []

    def _ask_for_recomputes(self) -> None:
        """Sequences preempted by recompute: the gateway has their tokens prefilled again at their priority."""
        asks = [Recompute(seq.request_id, seq.index, tuple(seq.tokens[:-1]), seq.sampling, seq.priority)
                for seq in self.engine.recompute_requests]
        self.engine.recompute_requests.clear()
        if asks:
            self.loop.call_soon_threadsafe(self.send_recomputes, asks)

    def _publish(self, events: list[TokenEvent]) -> None:
        if events:
            self.loop.call_soon_threadsafe(self.send_events, events)
