"""A child's stderr, passed through to the gateway's own and its last lines kept: the reason a start failed.

Children used to write straight to the gateway's stderr; they still do, through a pipe a thread reads, so that
when one dies before it was ever ready the supervisor can say why (llama.cpp's assertion, a Python traceback's
last line) instead of only its exit code. The thread never stops reading while the child lives, so a child cannot
block on its stderr any more than before; a stream without newlines is kept to its last TAIL_BYTES.
"""

from __future__ import annotations

import os
import threading

TAIL_BYTES = 4096
STDERR_FD = 2  # the gateway's own stderr, which the children wrote to before (systemd's journal, a terminal)


class StderrTail:
    def __init__(self, pipe, name: str, sink_fd: int = STDERR_FD) -> None:
        self._pipe, self._sink_fd = pipe, sink_fd
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name=f"{name} stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        fd = self._pipe.fileno()
        try:
            while chunk := os.read(fd, 65536):
                self._pass_on(chunk)
                with self._lock:
                    self._tail += chunk
                    del self._tail[:-TAIL_BYTES]
        except OSError:  # the pipe closed under us: nothing more will come
            pass
        finally:
            self._pipe.close()

    def _pass_on(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            try:
                view = view[os.write(self._sink_fd, view):]
            except OSError:  # the gateway's stderr is gone: keep draining the child regardless
                return

    def last_lines(self, count: int = 3, wait_s: float = 0.5) -> list[str]:
        """The child's last non-empty lines, once what it wrote before exiting is read (up to wait_s: a process it
        started may hold the pipe open)."""
        self._thread.join(wait_s)
        with self._lock:
            text = bytes(self._tail).decode("utf-8", errors="replace")
        return [line.strip() for line in text.splitlines() if line.strip()][-count:]
