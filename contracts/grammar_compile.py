"""Where structured-output compiles run: never on the caller's thread (the gateway's event loop, the prefill thread,
the engine thread), a bounded number at once, each under the compile time limit (grammar_compile_timeout_s).

The costly and unbounded part, turning a constraint into a grammar, runs in child processes
(contracts.compile_processes), which are killed at the limit: the gateway's check compiles there whole, over the
model's vocabulary, and a prefill worker or the engine gets the checked grammar text from one and builds its matcher
in a pool thread (a step that llguidance's own work limits bound: contracts.grammar.limits). A pool thread waiting
past the limit is abandoned, and keeps its slot until the process answers or is killed, so waits cannot pile up;
with every slot taken a new compile is refused at once (GrammarBusyError, a 503) rather than queued behind them.

Every cache of compiles here (outcomes, grammars, compiles in flight) is kept per cache salt (the request's
PrefillJob.cache_salt, which the gateway derives from its API key: edge.core.cache_salt) as well as per constraint: a
compile answers, or is joined by, only requests of the salt that started it. Shared, a known schema would be
answered at once for anyone, and the time of an answer would tell a tenant which schemas another one sends.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from contracts.compile_processes import CompileCancelled, CompileProcesses
from contracts.grammar import (
    DEFAULT_COMPILE_TIMEOUT_S,
    GrammarBusyError,
    GrammarError,
    GrammarTooComplexError,
    Matcher,
    compile_matcher,
    matcher_of,
)

log = logging.getLogger(__name__)
# The gateway's check is the limit clients see. A prefill worker and the engine compile a constraint the gateway
# passed again, on their own busy CPUs: they allow this many times the limit before they fail the request.
DOWNSTREAM_MARGIN = 2.0
PROCESS_MARGIN_S = 0.5  # how much longer than the limit a caller waits for a compile process to say it stopped


def downstream_timeout_s(timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> float:
    return timeout_s * DOWNSTREAM_MARGIN


ConstraintKey = tuple[str, str, bytes]  # (cache salt, kind, digest of the source)


def constraint_key(kind: str, source: str, cache_salt: str = "") -> ConstraintKey:
    """What caches keep a constraint by: the cache salt of the request that asked (only requests of one salt share
    a compile), and the constraint's digest, not its text (up to 256 KiB each). "": unsalted (open access)."""
    return cache_salt, kind, hashlib.sha256(source.encode("utf-8", "surrogatepass")).digest()


def compile_timeout_s(*sources) -> float:
    """The first grammar_compile_timeout_s that one of the sources (a config, its limits) has; else the default."""
    for source in sources:
        value = getattr(source, "grammar_compile_timeout_s", None)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return DEFAULT_COMPILE_TIMEOUT_S


class CompilePool:
    def __init__(self, workers: int = 2, capacity: int = 8, name: str = "grammar") -> None:
        self.capacity = capacity
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(capacity)

    def submit(self, fn, *args) -> tuple[Future, threading.Event]:
        """(the compile's future, set once it has started); GrammarBusyError when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            raise GrammarBusyError(f"{self.capacity} structured-output compiles are already running; retry shortly")
        started = threading.Event()

        def job():
            started.set()
            return fn(*args)
        try:
            future = self._executor.submit(job)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _future: self._slots.release())
        return future, started

    def run(self, timeout_s: float, fn, *args):
        """fn(*args) in the pool, waited for at most timeout_s (blocking the calling thread only)."""
        future, started = self.submit(fn, *args)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            raise timed_out(future, started, timeout_s) from None


def timed_out(future: Future, started: threading.Event, timeout_s: float, cancel: bool = True) -> GrammarError:
    """A compile that never started waited behind others (busy; cancelled, unless others await it too); one that
    ran the whole time is too complex."""
    if (cancel and future.cancel()) or not started.is_set():
        return GrammarBusyError(f"no structured-output compile slot came free within {timeout_s:g} s; retry shortly")
    return GrammarTooComplexError(f"compiling the constraint took longer than the limit of {timeout_s:g} s")


class CompiledGrammars:
    """The compiled grammars of one vocabulary (a prefill worker's, the engine's), kept by cache salt and constraint
    (`entries` of them, least recently used dropped) and copied per sequence. `prepare` starts a compile from any
    thread without waiting; `matcher` waits for it at most timeout_s. The vocabulary (tokenizer(): an llguidance
    LLTokenizer) is built by the first compile, in the pool. A failed compile stays failed: its constraint is
    refused again at once (for its salt). cache_salt: the request's (PrefillJob.cache_salt); a compile, running or
    done, serves that salt only."""

    def __init__(self, tokenizer: Callable, stop_token_ids: tuple[int, ...], timeout_s: float,
                 pool: CompilePool, entries: int = 64, processes: CompileProcesses | None = None) -> None:
        self._tokenizer, self._stops = tokenizer, tuple(stop_token_ids)
        self._processes = processes  # None: the whole compile in the pool thread (tests, tools)
        self.timeout_s = timeout_s
        self._pool, self._entries = pool, entries
        self._lock = threading.Lock()
        self._compiled: OrderedDict[ConstraintKey, tuple[Future, threading.Event]] = OrderedDict()

    def prepare(self, kind: str, source: str, cache_salt: str = "") -> Future:
        """The compile's future (its result: a Matcher at the grammar's start); GrammarBusyError if the pool is full."""
        return self._running(kind, source, cache_salt)[0]

    def matcher(self, kind: str, source: str, cache_salt: str = "") -> Matcher:
        """A fresh matcher of the constraint: GrammarError when it does not compile, GrammarTooComplexError past the
        time limit, GrammarBusyError when no compile slot is free."""
        future, started = self._running(kind, source, cache_salt)
        try:  # the compile process stops at the limit itself; a little more lets its answer arrive
            return future.result(self.timeout_s + (PROCESS_MARGIN_S if self._processes else 0)).copy()
        except FutureTimeout:
            raise timed_out(future, started, self.timeout_s, cancel=False) from None

    def _running(self, kind: str, source: str, cache_salt: str) -> tuple[Future, threading.Event]:
        key = constraint_key(kind, source, cache_salt)
        with self._lock:
            running = self._compiled.get(key)
            if running is None or running[0].cancelled() or _busy(running[0]):
                running = self._pool.submit(self._compile, kind, source)
                self._compiled[key] = running
                if len(self._compiled) > self._entries:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
            return running

    def _compile(self, kind: str, source: str) -> Matcher:
        if self._processes is None:
            return compile_matcher(self._tokenizer(), kind, source, self._stops)
        grammar = self._processes.run(kind, source, self.timeout_s, "grammar")
        return matcher_of(self._tokenizer(), kind, grammar, self._stops)

    def close(self) -> None:
        if self._processes is not None:
            self._processes.close()


def _busy(future: Future) -> bool:
    """A compile that found no process free: about that moment, not the constraint, so it is tried again."""
    return future.done() and isinstance(future.exception(), GrammarBusyError)


class GatewayCheck:
    """The gateway's check of a constraint before it admits the request: compiled in a child process
    (contracts.compile_processes) exactly as a prefill worker will compile it (over the model's vocabulary when the
    processes load it: llguidance's own validation passes grammars whose matcher then fails to build), awaited at
    most the time limit, and stopped there: the process is killed, and so is the compile of a client that goes
    away. The event loop only awaits; a thread of the compile's own waits on the process.

    The outcome is kept per cache salt and constraint (clients repeat theirs; `entries` outcomes, least recently
    used dropped); requests of one owner and salt with the same constraint still compiling await the same compile.
    A compile stopped at the limit is remembered as too complex, so that a later request of its salt with it is
    refused at once. owner: whose share of the processes a compile takes (an API key, or the client's address
    without keys). cache_salt: the request's (edge.core.cache_salt): another salt's outcome is never its answer, nor is
    another salt's compile in flight, so a tenant cannot time whether another sent a schema."""

    def __init__(self, processes: CompileProcesses | None = None, entries: int = 256) -> None:
        self.processes = processes or CompileProcesses()
        self._entries = entries
        self._lock = threading.Lock()  # the outcomes are written by the compiles' threads
        self._outcomes: OrderedDict[ConstraintKey, GrammarError | None] = OrderedDict()
        self._compiling: dict[tuple, _Shared] = {}  # (owner, salted constraint) -> its compile; event loop only

    async def check(self, kind: str, source: str, timeout_s: float, owner: str | None = None,
                    cache_salt: str = "") -> None:
        """Return if the constraint compiles; raise GrammarError (or its subclasses) saying why not."""
        key = constraint_key(kind, source, cache_salt)
        if self._known(key):
            return
        shared = self._compiling.get((owner, key))
        if shared is None:
            shared = self._compiling[owner, key] = _Shared()
            threading.Thread(target=self._compile, args=(key, source, timeout_s, owner, shared), daemon=True,
                             name="gateway-grammar").start()
        shared.waiters += 1
        try:
            outcome = await asyncio.shield(asyncio.wrap_future(shared.future))
        finally:
            shared.waiters -= 1
            if shared.waiters == 0:  # the last requester went away (or has its answer): nobody needs the compile
                shared.cancelled.set()
                if self._compiling.get((owner, key)) is shared:
                    del self._compiling[owner, key]
        if outcome is not None:
            raise outcome

    def close(self) -> None:
        """Stop every compile (at shutdown): their requests end at once."""
        self.processes.close()

    def _known(self, key: ConstraintKey) -> bool:
        """True if the constraint was checked before and compiles; raises its error if it did not."""
        with self._lock:
            if key not in self._outcomes:
                return False
            self._outcomes.move_to_end(key)
            outcome = self._outcomes[key]
        if outcome is not None:
            raise outcome
        return True

    def _compile(self, key: ConstraintKey, source: str, timeout_s: float, owner: str | None,
                 shared: _Shared) -> None:
        kind = key[1]
        try:
            self.processes.run(kind, source, timeout_s, "check", owner, shared.cancelled)
            outcome = None
        except (GrammarBusyError, CompileCancelled) as err:  # about the moment, not the constraint: not kept
            shared.future.set_result(err)
            return
        except GrammarError as err:
            outcome = err
        except Exception as err:  # whatever else fails, the constraint is not enforceable: refused, not passed
            log.exception("structured outputs: the gateway's check failed")
            outcome = GrammarError(f"the {kind} constraint could not be checked: {err}")
        with self._lock:
            self._outcomes[key] = outcome
            if len(self._outcomes) > self._entries:
                self._outcomes.popitem(last=False)
        shared.future.set_result(outcome)


class _Shared:
    """One compile of the gateway's check and the requests awaiting it."""

    __slots__ = ("cancelled", "future", "waiters")

    def __init__(self) -> None:
        self.future: Future = Future()
        self.cancelled = threading.Event()
        self.waiters = 0
