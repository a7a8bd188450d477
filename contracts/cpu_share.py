"""Decode and prefill on the same cores: the decode engine, when it runs on the CPU, publishes whether it is
decoding, and the best priority it decodes, in a 4-byte file in the launch's run directory; local prefill
workers read it before each llama.cpp chunk and use half their threads while decode of at least their
prompt's priority runs (a prompt that outranks every decoding sequence gets all the cores: that decode
yields to it, docs/config.md; a request with a TTFT objective and none per token yields to its own priority's
prompts, so the engine publishes it at the next level: decode_gpu/core/priority_gate.py). The engine halves its
own threads while any prompt is queued for or in prefill, from the priority signal it already gets.

Two thread pools on the same cores slow each other far more than splitting the cores costs. On the 2-core
development machine (`python -m bench.cpu_share_bench`, docs/decode.md), a batch-8 decode step next to a
prefill loop: 2 torch + 2 llama.cpp threads, 141 ms per step and 186 prefill tok/s; 1 + 1, 74 ms and 194.
Alone, each runs best on every core (44 ms; 375 tok/s).

A file, not a control frame: it is only meaningful where both processes share a machine, which is exactly
where they share a run directory. A missing file (remote engine, engine not started) reads as idle.
"""

from __future__ import annotations

import os
import struct

IDLE = 2**31 - 1  # what the file holds while nothing decodes
_FORMAT = "<i"


class CpuShare:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._published: int | None = None

    # --- the engine (writer) ---
    def set_decoding(self, best_priority: int | None) -> None:
        """Publish the best (lowest) priority among the sequences decoding now, None when none; writes only on
        a change."""
        value = IDLE if best_priority is None else best_priority
        if value == self._published:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(self._fd, struct.pack(_FORMAT, value), 0)
        self._published = value

    # --- a prefill worker (reader) ---
    def decoding(self) -> int | None:
        """The best priority the engine decodes now, None when it is idle or its file does not exist yet."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return None
        raw = os.pread(self._fd, 4, 0)
        value = struct.unpack(_FORMAT, raw)[0] if len(raw) == 4 else IDLE
        return None if value == IDLE else value

    def threads_for(self, priority: int, threads: int) -> int:
        """A prompt of this priority: all threads unless decode at least as important runs (it does not yield)."""
        best = self.decoding()
        return threads if best is None or priority < best else split_threads(threads)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def split_threads(threads: int) -> int:
    """Threads for one side while both run: half, at least one."""
    return max(1, threads // 2)
