"""Decode and prefill on the same cores: the decode engine, when it runs on the CPU, publishes whether it is
decoding in a one-byte file in the launch's run directory, and local prefill workers read it before each
llama.cpp chunk, using half their threads while it is (the engine does the same while a prompt is in
prefill, from the priority signal it already gets).

Two thread pools on the same cores slow each other far more than splitting the cores costs. On the 2-core
development machine, a batch-8 decode step next to a 256-token prefill loop (bench numbers in
docs/decode.md): 2 torch + 2 llama.cpp threads, 129 ms per step and 122 prefill tok/s; 1 + 2, 85 ms and 142;
1 + 1, 78 ms and 183. Alone, each runs best on every core (50 ms, 347 tok/s).

A file, not a control frame: it is only meaningful where both processes share a machine, which is exactly
where they share a run directory. A missing file (remote engine, engine not started) reads as idle.
"""

from __future__ import annotations

import os


class CpuShare:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._published: bool | None = None

    # --- the engine (writer) ---
    def set_decoding(self, active: bool) -> None:
        """Publish the engine's state; writes only on a change."""
        if active == self._published:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(self._fd, b"\1" if active else b"\0", 0)
        self._published = active

    # --- a prefill worker (reader) ---
    def decoding(self) -> bool:
        """Whether the engine said it is decoding; False until its file exists."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False
        return os.pread(self._fd, 1, 0) == b"\1"

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def split_threads(threads: int) -> int:
    """Threads for one side while both run: half, at least one."""
    return max(1, threads // 2)
