"""Trampoline for supervised children: `python -m edge.launch.child_main <module> <args...>`.

It arranges, inside the child, for the child to die with the gateway and then runs <module> as `python -m`
would. This replaces a `preexec_fn`, which runs Python code between fork and exec and can deadlock when
the parent has other threads (a lock held by one of them is copied locked into the child).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PARENT_PID_ENV = "EDGE_SUPERVISOR_PID"  # set by the supervisor to its own pid
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the parent dies; the target modules stop cleanly on SIGTERM."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor's shutdown still stops the children


def parent_gone(expected_pid: str | None) -> bool:
    """The parent may have died before prctl ran; the signal then never comes, but we were reparented."""
    return expected_pid is not None and os.getppid() != int(expected_pid)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m edge.launch.child_main <module> [args...]")
    die_with_parent()
    # popped so that the target's own children do not compare their parent against the gateway
    if parent_gone(os.environ.pop(PARENT_PID_ENV, None)):
        sys.exit("edge.launch.child_main: the supervisor exited before this child started; not starting")
    module, *args = argv
    sys.argv = [module, *args]  # run_module replaces argv[0] with the module's path, as `python -m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
