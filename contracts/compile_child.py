"""One structured-output compile process: its main (`python -m contracts.compile_child`, started by
contracts.compile_processes.CompileProcesses) and the parent's handle of it (`CompileChild`).

The child speaks JSON lines on its own pipe: {"kind", "source", "mode"} in, {"grammar"} or {"error", "message"}
out, after a first line "ready". It exits when its parent is gone."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from contracts.grammar import GrammarBusyError, GrammarError

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often a waiting caller looks at its cancel event
_ROOT = str(Path(__file__).resolve().parent.parent)


class CompileCancelled(GrammarError):
    """The caller went away (its cancel event was set); the compile's process was killed."""

    code = "cancelled"


class CompileChild:
    """One compile process; used by one caller at a time."""

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self._buffer = b""

    def line(self, deadline: float, cancelled: threading.Event | None,
             closed: threading.Event | None = None) -> bytes | None:
        """The child's next line; None when the deadline passed; CompileCancelled when the requester went away,
        GrammarBusyError when the pool closed; EOFError when it died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if cancelled is not None and cancelled.is_set():
                raise CompileCancelled("the requester went away")
            if closed is not None and closed.is_set():
                raise GrammarBusyError("the server is shutting down")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(POLL_S, left))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError("the compile process exited")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def ask(self, request: dict, deadline: float, cancelled: threading.Event | None,
            closed: threading.Event | None = None) -> dict | None:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.line(deadline, cancelled, closed)
        return None if line is None else json.loads(line)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


def _serve(vocabulary, out) -> None:
    from contracts.grammar import build_grammar, compile_matcher
    with contextlib.suppress(OSError):  # after the start (a replacement is ready sooner), before any compile
        os.nice(10)  # compiles take the cores that serving leaves: a stream's next token comes first
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        kind, source = request["kind"], request["source"]
        try:
            if request["mode"] == "grammar":
                answer = {"grammar": build_grammar(kind, source)}
            elif vocabulary is None:
                build_grammar(kind, source)
                answer = {}
            else:
                compile_matcher(vocabulary.tokenizer, kind, source, vocabulary.stop_token_ids)
                answer = {}
        except GrammarError as err:
            answer = {"error": err.code, "message": str(err)}
        except Exception as err:  # whatever else fails, the constraint is not enforceable: refused, not passed
            answer = {"error": GrammarError.code, "message": f"the {kind} constraint does not compile: {err}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (a compile releases the GIL, so this runs during one)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    import argparse
    parser = argparse.ArgumentParser(description="a structured-output compile process (started by its parent)")
    parser.add_argument("--vocabulary", default=None)
    parser.add_argument("--vocabulary-arg", default="")
    args = parser.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # the protocol has its own descriptor: what a library prints goes to stderr, never into an answer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    vocabulary = None
    if args.vocabulary:
        module, _, name = args.vocabulary.partition(":")
        try:
            vocabulary = getattr(importlib.import_module(module), name)(args.vocabulary_arg)
        except Exception:
            log.exception("structured outputs: the model's vocabulary did not load; this compile process checks "
                          "constraints without it")
    _serve(vocabulary, out)


if __name__ == "__main__":
    main()
