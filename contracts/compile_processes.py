"""Structured-output compiles in child processes, so that one can be stopped: a compile past its time limit, or
one whose requester went away, is ended by killing its process, which is then replaced. A thread cannot be
stopped; a process can, and its CPU comes back at once.

`CompileProcesses` keeps a few children (`python -m contracts.compile_processes`), each compiling one constraint
at a time. No owner (an API key, or a client address without keys) holds more than `per_owner` children at once,
so one key cannot fill the pool: its further compiles wait their turn in order, at most `queue_per_owner` of them
and at most the time limit (past either, GrammarOwnerBusyError, a 429), so that an honest client sending
structured requests in parallel is served, not refused. A caller whose turn came waits for a free child within
what is left of the time limit (then GrammarBusyError, a 503). A waiter whose requester goes away (its cancel
event) leaves its queue within POLL_S; close() ends every waiter at once (busy: shutting down). The calls block
their thread; the gateway makes them from a thread of their own (contracts.grammar_compile.GatewayCheck), never
from its event loop.

The child speaks JSON lines on its own pipe: {"kind", "source", "mode"} in, {"grammar"} or {"error", "message"}
out. mode "check" compiles over the vocabulary (when the child has one, as a prefill worker will compile) and
answers nothing but the outcome; mode "grammar" answers llguidance's checked grammar text, from which the caller
builds its matcher in its own process (the costly part, turning a schema into a grammar, ran in the child).
"""

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
from collections import deque
from pathlib import Path

from contracts.grammar import GrammarBusyError, GrammarError, GrammarOwnerBusyError, GrammarTooComplexError
from contracts.options import KNOBS

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0  # a child's imports and vocabulary, at most (a loaded machine); past it the child is killed
POLL_S = 0.05  # how often a waiting caller looks at its cancel event
QUEUE_PER_OWNER = KNOBS["grammar_compile_queue_per_key"].default
_ERRORS = {cls.code: cls for cls in (GrammarError, GrammarTooComplexError)}
_ROOT = str(Path(__file__).resolve().parent.parent)


class CompileCancelled(GrammarError):
    """The caller went away (its cancel event was set); the compile's process was killed."""

    code = "cancelled"


class _Turns:
    """One owner's compiles: how many hold a child now, and the callers waiting their turn (first in line first)."""

    __slots__ = ("running", "waiting")

    def __init__(self) -> None:
        self.running = 0
        self.waiting: deque[object] = deque()  # a ticket per waiting caller


class _Child:
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


class CompileProcesses:
    """workers: children kept (started on first use, replaced when killed). per_owner: children one owner may hold
    at once. vocabulary: "module:callable" that the child calls with vocabulary_arg to get an object with
    .tokenizer and .stop_token_ids (prefill_cpu.grammar:GGUFVocabulary), or None to check grammars alone.
    max_waiting: callers waiting for a child at most, and callers waiting their owner's turn at most (all owners
    together); past either a compile is refused at once (busy). queue_per_owner: callers of one owner waiting
    their turn at most (grammar_compile_queue_per_key); past it, a 429 at once."""

    def __init__(self, workers: int = 2, per_owner: int = 1, vocabulary: str | None = None,
                 vocabulary_arg: str = "", max_waiting: int = 32, queue_per_owner: int = QUEUE_PER_OWNER) -> None:
        self.workers, self.per_owner, self.max_waiting = workers, per_owner, max_waiting
        self.queue_per_owner = queue_per_owner
        self._argv = [sys.executable, "-m", "contracts.compile_processes"]
        if vocabulary:
            self._argv += ["--vocabulary", vocabulary, "--vocabulary-arg", vocabulary_arg]
        self._cond = threading.Condition()
        self._idle: list[_Child] = []
        self._children = 0  # started or starting, busy or idle
        self._starting = 0
        self._waiting = 0
        self._queued = 0  # callers waiting their owner's turn, all owners
        self._owners: dict[str, _Turns] = {}
        self._closed = False
        self._stopping = threading.Event()  # set by close(): compiles in progress stop at once
        self.killed = 0  # children killed at their limit or for a caller gone: for tests and logs
        self.compiles = 0  # constraints sent to a child: a cached outcome sends none (for /health and tests)

    def run(self, kind: str, source: str, timeout_s: float, mode: str = "check", owner: str | None = None,
            cancelled: threading.Event | None = None) -> str:
        """Compile in a child: the grammar text (mode "grammar") or "" (mode "check"). GrammarError (or a
        subclass) when the constraint does not compile or passed the limit, GrammarBusyError when no child came
        free within timeout_s, GrammarOwnerBusyError when the owner's queue is full or its turn did not come within
        timeout_s, CompileCancelled. The waits (the owner's turn, then a free child) take timeout_s together; the
        compile has its own timeout_s."""
        deadline = time.monotonic() + timeout_s
        if owner is not None:
            self._wait_turn(owner, deadline, timeout_s, cancelled)
        try:
            child = self._take(deadline, cancelled)
            return self._compile(child, kind, source, timeout_s, mode, cancelled)
        finally:
            if owner is not None:
                with self._cond:
                    self._owners[owner].running -= 1
                    self._forget(owner)
                    self._cond.notify_all()  # the owner's next in line goes now, not at its next poll

    def _wait_turn(self, owner: str, deadline: float, timeout_s: float, cancelled: threading.Event | None) -> None:
        """Return holding one of the owner's `per_owner` shares, taken in the order the callers came."""
        with self._cond:
            if self._closed:
                raise GrammarBusyError("the server is shutting down")
            turns = self._owners.setdefault(owner, _Turns())
            if turns.running < self.per_owner and not turns.waiting:
                turns.running += 1
                return
            self._refuse_queueing(turns)
            ticket = object()
            turns.waiting.append(ticket)
            self._queued += 1
            try:
                while turns.running >= self.per_owner or turns.waiting[0] is not ticket:
                    self._still_waiting(deadline, timeout_s, cancelled)
                    self._cond.wait(min(POLL_S, max(deadline - time.monotonic(), 0.001)))
                turns.running += 1
            finally:
                turns.waiting.remove(ticket)
                self._queued -= 1
                self._forget(owner)
                self._cond.notify_all()  # the next in line may be first now

    def _refuse_queueing(self, turns: _Turns) -> None:
        if len(turns.waiting) >= self.queue_per_owner:
            raise GrammarOwnerBusyError(f"this client already has {turns.running} structured-output compile(s) "
                                        f"running and {len(turns.waiting)} waiting; retry when they end")
        if self._queued >= self.max_waiting:
            raise GrammarBusyError(f"{self._queued} structured-output compiles are waiting; retry shortly")

    def _still_waiting(self, deadline: float, timeout_s: float, cancelled: threading.Event | None) -> None:
        """Raise if a caller waiting its owner's turn must stop: the server closing, its requester gone, its time."""
        if self._closed:
            raise GrammarBusyError("the server is shutting down")
        if cancelled is not None and cancelled.is_set():
            raise CompileCancelled("the requester went away")
        if time.monotonic() >= deadline:
            raise GrammarOwnerBusyError(f"this client's structured-output compiles ahead of this one did not end "
                                        f"within the limit of {timeout_s:g} s; retry when they end")

    def _forget(self, owner: str) -> None:
        """Drop an owner with nothing running or waiting (under the condition)."""
        turns = self._owners.get(owner)
        if turns is not None and turns.running <= 0 and not turns.waiting:
            del self._owners[owner]

    def _compile(self, child: _Child, kind: str, source: str, timeout_s: float, mode: str,
                 cancelled: threading.Event | None) -> str:
        keep, reason = False, "the compiler failed"
        with self._cond:
            self.compiles += 1
        try:
            answer = child.ask({"kind": kind, "source": source, "mode": mode}, time.monotonic() + timeout_s,
                               cancelled, self._stopping)
            if answer is None:
                reason = f"past the limit of {timeout_s:g} s"
                raise GrammarTooComplexError(f"compiling the {kind} constraint took longer than the limit of "
                                             f"{timeout_s:g} s; it was stopped")
            keep = True
        except CompileCancelled:
            reason = "its requester went away"
            raise
        except GrammarBusyError:
            reason = "the server is shutting down"
            raise
        except GrammarError:
            raise
        except (EOFError, OSError, ValueError):
            log.warning("structured outputs: a compile process died on a %s constraint", kind)
            raise GrammarError(f"the {kind} constraint could not be compiled (the compiler failed)") from None
        finally:
            self._give_back(child, keep, reason)
        if "error" in answer:
            raise _ERRORS.get(answer["error"], GrammarError)(answer["message"])
        return answer.get("grammar", "")

    def _take(self, deadline: float, cancelled: threading.Event | None) -> _Child:
        with self._cond:
            if self._waiting >= self.max_waiting and not self._idle:
                raise GrammarBusyError(f"{self._waiting} structured-output compiles are waiting; retry shortly")
            self._waiting += 1
            try:
                while not self._idle:
                    if self._closed:
                        raise GrammarBusyError("the server is shutting down")
                    if cancelled is not None and cancelled.is_set():
                        raise CompileCancelled("the requester went away")
                    self._fill()
                    left = deadline - time.monotonic()
                    if left <= 0 and self._starting:  # a child on its way: its start is not the caller's wait
                        left = POLL_S
                    elif left <= 0:
                        raise GrammarBusyError("no structured-output compile process came free within the "
                                               "time limit; retry shortly")
                    self._cond.wait(min(POLL_S, left))
                return self._idle.pop()
            finally:
                self._waiting -= 1

    def _give_back(self, child: _Child, keep: bool, reason: str = "") -> None:
        if not keep:
            child.kill()
        with self._cond:
            if keep and not self._closed:
                self._idle.append(child)
            else:
                self._children -= 1
                self.killed += not keep
                if not keep:
                    log.info("structured outputs: a compile process was stopped (%s)", reason)
                if not self._closed:
                    self._fill()
            self._cond.notify_all()
        if keep and self._closed:
            child.kill()

    def _fill(self) -> None:
        """Start children up to `workers` (under the condition); each becomes idle once it says it is ready."""
        while self._children < self.workers:
            self._children += 1
            self._starting += 1
            threading.Thread(target=self._start, name="grammar-child-start", daemon=True).start()

    def _start(self) -> None:
        child = None
        try:
            child = _Child(self._argv)
            if child.line(time.monotonic() + START_TIMEOUT_S, None) != b"ready":
                raise OSError("no ready line")
        except (OSError, EOFError, ValueError) as err:
            log.error("structured outputs: a compile process did not start: %s", err)
            if child is not None:
                child.kill()
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()
            time.sleep(1.0)  # then the next caller starts another: not in a tight loop
            with self._cond:
                self._children -= 1
            return
        with self._cond:
            self._starting -= 1
            if self._closed:
                closed = True
            else:
                closed = False
                self._idle.append(child)
                self._cond.notify_all()
        if closed:
            child.kill()

    def state(self) -> dict:
        """For /health: processes idle, compiles running now, callers waiting for a process, callers waiting their
        key's turn, processes stopped so far, compiles sent to a process so far (every key's; a request's miss
        counts one whatever other tenants sent: only compiles of its own cache salt answer it)."""
        with self._cond:
            return {"idle": len(self._idle), "compiling": self._children - self._starting - len(self._idle),
                    "waiting": self._waiting, "queued": self._queued, "stopped": self.killed,
                    "compiles": self.compiles}

    def warm(self) -> None:
        """Start the children now rather than on the first compile (their imports take a second)."""
        with self._cond:
            if not self._closed:
                self._fill()

    def close(self) -> None:
        """Kill every child; callers waiting (for a child or their turn) or compiling end at once (busy)."""
        self._stopping.set()
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for child in idle:
            child.kill()


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
