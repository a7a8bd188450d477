"""Structured-output compiles in child processes, so that one can be stopped: a compile past its time limit, or
one whose requester went away, is ended by killing its process, which is then replaced. A thread cannot be
stopped; a process can, and its CPU comes back at once.

`CompileProcesses` keeps a few children (`python -m contracts.compile_child`), each compiling one constraint
at a time. No owner (an API key, or a client address without keys) holds more than `per_owner` children at once,
so one key cannot fill the pool: its further compiles wait their turn in order, at most `queue_per_owner` of them
and at most the time limit (past either, GrammarOwnerBusyError, a 429), so that an honest client sending
structured requests in parallel is served, not refused. A child that comes free goes to the owner that has
compiled least lately (first come first served among equals), so one owner's flood of slow compiles cannot fail
another owner's small one; a caller whose turn came waits for a free child within what is left of the time limit
and a margin (then GrammarBusyError, a 503). A waiter whose requester goes away (its cancel
event) leaves its queue within POLL_S; close() ends every waiter at once (busy: shutting down). The calls block
their thread; the gateway makes them from a thread of their own (contracts.grammar_compile.GatewayCheck), never
from its event loop.

The child speaks JSON lines on its own pipe: {"kind", "source", "mode"} in, {"grammar"} or {"error", "message"}
out. mode "check" compiles over the vocabulary (when the child has one, as a prefill worker will compile) and
answers nothing but the outcome; mode "grammar" answers llguidance's checked grammar text, from which the caller
builds its matcher in its own process (the costly part, turning a schema into a grammar, ran in the child).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import OrderedDict, deque

from contracts.compile_child import POLL_S, CompileCancelled, CompileChild  # noqa: F401 (CompileCancelled: re-exported)
from contracts.grammar import GrammarBusyError, GrammarError, GrammarOwnerBusyError, GrammarTooComplexError
from contracts.options import KNOBS

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0  # a child's imports and vocabulary, at most (a loaded machine); past it the child is killed
QUEUE_PER_OWNER = KNOBS["grammar_compile_queue_per_key"].default
WAIT_MARGIN_S = 0.5  # past the time limit, how long a caller still waits: a compile holding a child ends by its
# limit, and this covers its kill, so the caller next in line gets that child rather than a 503
USAGE_HALF_LIFE_S = 30.0  # how fast an owner's compiling is forgiven, for the order children are handed out in
_ERRORS = {cls.code: cls for cls in (GrammarError, GrammarTooComplexError)}


class _Ticket:
    """One caller waiting for a child: its owner, its place in arrival order, and whether it was turned away to
    make room for an owner with fewer callers waiting."""

    __slots__ = ("evicted", "owner", "seq")

    def __init__(self, owner: str | None, seq: int) -> None:
        self.owner, self.seq, self.evicted = owner, seq, False


class _Owner:
    """One owner's callers: how many hold a child now, and those waiting (first in line first)."""

    __slots__ = ("running", "waiting")

    def __init__(self) -> None:
        self.running = 0
        self.waiting: deque[_Ticket] = deque()


class _Usage:
    """Seconds of compiling per owner, halving every HALF_LIFE_S: who has compiled least lately goes first."""

    def __init__(self, half_life_s: float = 30.0, owners: int = 4096) -> None:
        self._half_life_s, self._owners = half_life_s, owners
        self._spent: OrderedDict[str, tuple[float, float]] = OrderedDict()  # owner -> (seconds, as of when)

    def of(self, owner: str | None, now: float) -> float:
        spent, when = self._spent.get(owner, (0.0, now))
        return spent * 0.5 ** ((now - when) / self._half_life_s)

    def add(self, owner: str | None, seconds: float, now: float) -> None:
        self._spent[owner] = (self.of(owner, now) + seconds, now)
        self._spent.move_to_end(owner)
        while len(self._spent) > self._owners:  # the owner unheard of longest is forgotten (it starts again at 0)
            self._spent.popitem(last=False)


class CompileProcesses:
    """workers: children kept (started on first use, replaced when killed). per_owner: children one owner may hold
    at once. vocabulary: "module:callable" that the child calls with vocabulary_arg to get an object with
    .tokenizer and .stop_token_ids (prefill_cpu.grammar:GGUFVocabulary), or None to check grammars alone.
    max_waiting: callers waiting at most, all owners together; past it the owner with the most callers waiting
    gives up its last one (busy) for an owner with fewer, else the compile is refused at once (busy).
    queue_per_owner: callers of one owner waiting behind its running ones at most (grammar_compile_queue_per_key);
    past it, a 429 at once.

    A child that comes free goes to the caller first in its owner's line whose owner has compiled least lately
    (seconds of compiling, halving every USAGE_HALF_LIFE_S), first come first served among equals: an owner
    flooding the pool with slow compiles goes after one that sends a small schema now and then."""

    def __init__(self, workers: int = 2, per_owner: int = 1, vocabulary: str | None = None,
                 vocabulary_arg: str = "", max_waiting: int = 64, queue_per_owner: int = QUEUE_PER_OWNER) -> None:
        self.workers, self.per_owner, self.max_waiting = workers, per_owner, max_waiting
        self.queue_per_owner = queue_per_owner
        self._argv = [sys.executable, "-m", "contracts.compile_child"]
        if vocabulary:
            self._argv += ["--vocabulary", vocabulary, "--vocabulary-arg", vocabulary_arg]
        self._cond = threading.Condition()
        self._idle: list[CompileChild] = []
        self._children = 0  # started or starting, busy or idle
        self._starting = 0
        self._tickets: list[_Ticket] = []  # every caller waiting for a child, all owners
        self._seq = 0
        self._owners: dict[str | None, _Owner] = {}
        self._usage = _Usage(USAGE_HALF_LIFE_S)
        self._closed = False
        self._stopping = threading.Event()  # set by close(): compiles in progress stop at once
        self.killed = 0  # children killed at their limit or for a caller gone: for tests and logs
        self.compiles = 0  # constraints sent to a child: a cached outcome sends none (for /health and tests)

    def run(self, kind: str, source: str, timeout_s: float, mode: str = "check", owner: str | None = None,
            cancelled: threading.Event | None = None) -> str:
        """Compile in a child: the grammar text (mode "grammar") or "" (mode "check"). GrammarError (or a
        subclass) when the constraint does not compile or passed the limit, GrammarBusyError when no child came
        free within the wait, GrammarOwnerBusyError when the owner's queue is full or its own compiles ahead did
        not end within the wait, CompileCancelled. The wait (the owner's turn, then a free child) takes at most
        timeout_s + WAIT_MARGIN_S (a compile holding a child ends by its limit: the margin covers its kill); the
        compile has its own timeout_s."""
        child = self._take(owner, time.monotonic() + timeout_s + WAIT_MARGIN_S, timeout_s, cancelled)
        return self._compile(child, owner, kind, source, timeout_s, mode, cancelled)

    def _take(self, owner: str | None, deadline: float, timeout_s: float,
              cancelled: threading.Event | None) -> CompileChild:
        """A child, taken when it is this caller's turn (_next): the owner's share and the line are held under
        the condition from the moment the child is taken until it is given back."""
        with self._cond:
            if self._closed:
                raise GrammarBusyError("the server is shutting down")
            ticket = self._enter(owner)
            try:
                while not (self._idle and self._next() is ticket):
                    self._still_waiting(ticket, deadline, timeout_s, cancelled)
                    self._fill()
                    self._cond.wait(min(POLL_S, max(deadline - time.monotonic(), 0.001)))
                self._owners[owner].running += 1
                return self._idle.pop()
            finally:
                if not ticket.evicted:  # (an evicted one was taken out of both lines already)
                    self._tickets.remove(ticket)
                    self._owners[owner].waiting.remove(ticket)
                self._forget(owner)
                self._cond.notify_all()  # the next in line may be first now

    def _enter(self, owner: str | None) -> _Ticket:
        """The caller's ticket, in its owner's line and the pool's (under the condition); refused when its owner's
        queue is full (429) or every waiting place is taken by owners with as many callers waiting (503)."""
        turns = self._owners.setdefault(owner, _Owner())
        if owner is not None and (turns.running >= self.per_owner or turns.waiting) \
                and len(turns.waiting) >= self.queue_per_owner:
            self._forget(owner)
            raise GrammarOwnerBusyError(f"this client already has {turns.running} structured-output compile(s) "
                                        f"running and {len(turns.waiting)} waiting; retry when they end")
        if len(self._tickets) >= self.max_waiting and not self._evict_for(turns):
            self._forget(owner)
            raise GrammarBusyError(f"{len(self._tickets)} structured-output compiles are waiting; retry shortly")
        self._seq += 1
        ticket = _Ticket(owner, self._seq)
        turns.waiting.append(ticket)
        self._tickets.append(ticket)
        return ticket

    def _evict_for(self, turns: _Owner) -> bool:
        """Turn away the last caller of the owner with the most waiting, if it has at least two more than this
        owner (so that the waiting places are shared out between owners, and owners with one caller each do not
        take each other's places); False when none has."""
        longest = max(self._owners.values(), key=lambda other: len(other.waiting))
        if len(longest.waiting) < len(turns.waiting) + 2:
            return False
        victim = longest.waiting.pop()
        self._tickets.remove(victim)
        victim.evicted = True
        self._cond.notify_all()
        return True

    def _next(self) -> _Ticket | None:
        """Whose turn it is (under the condition): of the callers that may take a child now (_ready), the one whose
        owner compiled least lately; among equals the first come."""
        now = time.monotonic()
        return min(self._ready(), key=lambda t: (self._usage.of(t.owner, now), t.seq), default=None)

    def _ready(self) -> list[_Ticket]:
        """The callers first in their owner's line whose owner holds fewer than per_owner children, and every
        caller without an owner (a prefill worker's or the engine's compiles: no share to keep)."""
        ready: list[_Ticket] = []
        for owner, turns in self._owners.items():
            if owner is None:
                ready.extend(turns.waiting)
            elif turns.waiting and turns.running < self.per_owner:
                ready.append(turns.waiting[0])
        return ready

    def _still_waiting(self, ticket: _Ticket, deadline: float, timeout_s: float,
                       cancelled: threading.Event | None) -> None:
        """Raise if a waiting caller must stop: the server closing, its requester gone, its place given to another
        owner, its time (a child on its way extends it: a start is not the caller's wait)."""
        if self._closed:
            raise GrammarBusyError("the server is shutting down")
        if cancelled is not None and cancelled.is_set():
            raise CompileCancelled("the requester went away")
        if ticket.evicted:
            raise GrammarBusyError(f"{self.max_waiting} structured-output compiles are waiting, and this client has "
                                   "the most of them; retry shortly")
        if time.monotonic() < deadline or self._starting:
            return
        turns = self._owners[ticket.owner]
        if ticket.owner is not None and (turns.waiting[0] is not ticket or turns.running >= self.per_owner):
            raise GrammarOwnerBusyError(f"this client's structured-output compiles ahead of this one did not end "
                                        f"within the limit of {timeout_s:g} s; retry when they end")
        raise GrammarBusyError("no structured-output compile process came free within the time limit; retry "
                               "shortly")

    def _forget(self, owner: str | None) -> None:
        """Drop an owner with nothing running or waiting (under the condition)."""
        turns = self._owners.get(owner)
        if turns is not None and turns.running <= 0 and not turns.waiting:
            del self._owners[owner]

    def _compile(self, child: CompileChild, owner: str | None, kind: str, source: str, timeout_s: float, mode: str,
                 cancelled: threading.Event | None) -> str:
        keep, reason, started = False, "the compiler failed", time.monotonic()
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
            self._give_back(child, owner, keep, reason, time.monotonic() - started)
        if "error" in answer:
            raise _ERRORS.get(answer["error"], GrammarError)(answer["message"])
        return answer.get("grammar", "")

    def _give_back(self, child: CompileChild, owner: str | None, keep: bool, reason: str, seconds: float) -> None:
        """The child back to the pool (killed unless keep) and the owner's share with it, in one step: the next in
        line (_next) sees both at once, so no other owner's caller can take the child in between."""
        if not keep:
            child.kill()
        with self._cond:
            self._usage.add(owner, seconds, time.monotonic())
            self._owners[owner].running -= 1
            self._forget(owner)
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
            child = CompileChild(self._argv)
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
            waiting = len(self._ready())
            return {"idle": len(self._idle), "compiling": self._children - self._starting - len(self._idle),
                    "waiting": waiting, "queued": len(self._tickets) - waiting, "stopped": self.killed,
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
