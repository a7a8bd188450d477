"""Decode yields the CPU to a more important prompt that is waiting for, or in, prefill.

On a CPU-only box, llama.cpp prefill and torch decode share the same cores, so a background batch that
keeps decoding slows an interactive prompt's prefill, and the interactive first token with it. The
gateway tells the engine the best (lowest) priority among prompts queued or prefilling; while that ranks
strictly above a sequence, that sequence sits out decode steps (the engine decodes only the sequences
that rank as high), and a step already under way with none of them waits between two decoder layers
(milliseconds, not a whole step). A hold never stalls decode for longer than max_hold_s at a stretch, so a
lost release or a stream of important prompts cannot starve the rest.

Within one priority, a request whose class promises a first token in time and nothing per token (a TTFT objective,
no TPOT objective) decodes at half a level below its own (Sequence.decode_priority): its choices yield to the prompts
of their own priority waiting for a first token, which the gateway admitted because they fit their objective. On a
CPU a prefill beside decode runs on half the threads, so a burst's first answers, decoding, took about twice the
time from each prompt after them (issue 47). Such peer holds are bounded in their duty: at most max_hold_s in any
window of twice that (the window opens at the first peer hold after the last one closed), so a steady stream of
prompts cannot stall those answers for longer than it lets them run.
"""

from __future__ import annotations

import math
import threading
import time


class PriorityGate:
    def __init__(self, enabled: bool, max_hold_s: float = 2.0) -> None:
        self.enabled = enabled
        self.max_hold_s = max_hold_s
        self._changed = threading.Condition()
        self._held_for: int | None = None  # best priority waiting for or in prefill; None: nothing to yield to
        self._held_since = 0.0
        self.waited_s = 0.0  # total time decode yielded, for stats
        # prompts wait in the gateway's queue for a busy prefill worker (what the engine may pace its steps for)
        self.backlog = False
        self._peer_window = (-math.inf, -math.inf)  # (opened, when the next may open): peer holds, see the module

    def hold(self, priority: int | None) -> None:
        """The best priority among prompts queued or prefilling (None: none). Any thread."""
        with self._changed:
            if priority != self._held_for:
                self._held_for, self._held_since = priority, time.monotonic()
                self._changed.notify_all()

    @property
    def held_for(self) -> int | None:
        """The best priority among prompts queued for or in prefill (None: none)."""
        return self._held_for

    @property
    def prefill_active(self) -> bool:
        """Whether any prompt is queued for or in prefill (whatever its priority, however long held)."""
        return self._held_for is not None

    def outranks(self, priority: float) -> bool:
        """Whether a sequence of this (decode) priority should yield now."""
        return self._hold_end(priority, time.monotonic()) is not None

    def _hold_end(self, priority: float, now: float) -> float | None:
        """Until when a sequence of this decode priority yields now (None: it does not): a prompt of a better level
        holds it up to max_hold_s from the hold's start; one of its own level (priority - held_for < 1: a peer
        hold) within the open peer window only. Engine thread."""
        held_for = self._held_for
        if not self.enabled or held_for is None or held_for >= priority:
            return None
        if priority - held_for >= 1:
            end = self._held_since + self.max_hold_s
        else:
            opened, next_open = self._peer_window
            if now >= next_open:
                opened = now
                self._peer_window = (now, now + 2 * self.max_hold_s)
            end = opened + self.max_hold_s
        return end if now < end else None

    def wait_turn(self, batch_priority: float) -> None:
        """Engine thread: block while a more important prompt is in prefill (up to max_hold_s), or a peer's within
        the peer window."""
        if not self.outranks(batch_priority):
            return
        started = time.monotonic()
        with self._changed:
            while (end := self._hold_end(batch_priority, time.monotonic())) is not None:
                self._changed.wait(end - time.monotonic())
        self.waited_s += time.monotonic() - started
