"""Decode yields the CPU to a more important prompt that is waiting for, or in, prefill.

On a CPU-only box, llama.cpp prefill and torch decode share the same cores, so a background batch that
keeps decoding slows an interactive prompt's prefill, and the interactive first token with it. The
gateway tells the engine the best (lowest) priority among prompts queued or prefilling; while that ranks
strictly above a sequence, that sequence sits out decode steps (the engine decodes only the sequences
that rank as high), and a step already under way with none of them waits between two decoder layers
(milliseconds, not a whole step). A hold never stalls decode for longer than max_hold_s at a stretch, so a
lost release or a stream of important prompts cannot starve the rest.
"""

from __future__ import annotations

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

    def outranks(self, priority: int) -> bool:
        """Whether a sequence of this priority should yield now."""
        held_for = self._held_for
        return (self.enabled and held_for is not None and held_for < priority
                and time.monotonic() < self._held_since + self.max_hold_s)

    def wait_turn(self, batch_priority: int) -> None:
        """Engine thread: block while a strictly more important prompt is in prefill (up to max_hold_s)."""
        if not self.outranks(batch_priority):
            return
        started = time.monotonic()
        with self._changed:
            while self._held_for is not None and self._held_for < batch_priority:
                remaining = self._held_since + self.max_hold_s - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
        self.waited_s += time.monotonic() - started
