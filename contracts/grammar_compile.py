"""Where structured-output compiles run: off the caller's thread (the gateway's event loop, the prefill thread, the
engine thread), a bounded number at once, each under the compile time limit (grammar_compile_timeout_s).

A compile past its limit is abandoned, not stopped (a thread cannot be): it keeps its slot until it ends, so
abandoned compiles cannot pile up; with every slot taken a new compile is refused at once (GrammarBusyError, a 503)
rather than queued behind them. llguidance's own work limits (contracts.grammar.limits) end every compile.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from contracts.grammar import (
    DEFAULT_COMPILE_TIMEOUT_S,
    GrammarBusyError,
    GrammarError,
    GrammarTooComplexError,
    Matcher,
    build_grammar,
    compile_matcher,
)

log = logging.getLogger(__name__)
# The gateway's check is the limit clients see. A prefill worker and the engine compile a constraint the gateway
# passed again, on their own busy CPUs: they allow this many times the limit before they fail the request.
DOWNSTREAM_MARGIN = 2.0


def downstream_timeout_s(timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> float:
    return timeout_s * DOWNSTREAM_MARGIN


def constraint_key(kind: str, source: str) -> tuple[str, bytes]:
    """What caches keep a constraint by: its digest, not its text (up to 256 KiB each)."""
    return kind, hashlib.sha256(source.encode("utf-8", "surrogatepass")).digest()


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
    """The compiled grammars of one vocabulary (a prefill worker's, the engine's), kept by constraint (least
    recently used dropped) and copied per sequence. `prepare` starts a compile from any thread without waiting;
    `matcher` waits for it at most timeout_s. The vocabulary (tokenizer(): an llguidance LLTokenizer) is built by
    the first compile, in the pool. A failed compile stays failed: its constraint is refused again at once."""

    def __init__(self, tokenizer: Callable, stop_token_ids: tuple[int, ...], timeout_s: float,
                 pool: CompilePool, entries: int = 64) -> None:
        self._tokenizer, self._stops = tokenizer, tuple(stop_token_ids)
        self.timeout_s = timeout_s
        self._pool, self._entries = pool, entries
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, bytes], tuple[Future, threading.Event]] = OrderedDict()

    def prepare(self, kind: str, source: str) -> Future:
        """The compile's future (its result: a Matcher at the grammar's start); GrammarBusyError if the pool is full."""
        return self._running(kind, source)[0]

    def matcher(self, kind: str, source: str) -> Matcher:
        """A fresh matcher of the constraint: GrammarError when it does not compile, GrammarTooComplexError past the
        time limit, GrammarBusyError when no compile slot is free."""
        future, started = self._running(kind, source)
        try:
            return future.result(self.timeout_s).copy()
        except FutureTimeout:
            raise timed_out(future, started, self.timeout_s, cancel=False) from None

    def _running(self, kind: str, source: str) -> tuple[Future, threading.Event]:
        key = constraint_key(kind, source)
        with self._lock:
            running = self._compiled.get(key)
            if running is None or running[0].cancelled():
                running = self._pool.submit(self._compile, kind, source)
                self._compiled[key] = running
                if len(self._compiled) > self._entries:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
            return running

    def _compile(self, kind: str, source: str) -> Matcher:
        return compile_matcher(self._tokenizer(), kind, source, self._stops)


class GatewayCheck:
    """The gateway's check of a constraint before it admits the request: compiled in the pool exactly as a prefill
    worker will compile it (over the model's vocabulary, when `vocabulary` gives it: llguidance's own validation
    passes grammars whose matcher then fails to build), awaited at most the time limit. The outcome is kept per
    constraint (clients repeat theirs); requests whose constraint is still compiling await the same compile. A
    compile that ends past the limit is remembered as too complex, so that a later request with it is refused at
    once. vocabulary: a callable giving an object with .tokenizer (an LLTokenizer) and .stop_token_ids
    (prefill_cpu.grammar.GGUFVocabulary), called once, off the event loop, not timed; None, or a vocabulary that
    fails to load, checks the grammar alone (a worker may then still refuse it)."""

    def __init__(self, vocabulary: Callable | None = None, pool: CompilePool | None = None,
                 entries: int = 256) -> None:
        # one compile at a time: however many abusive schemas arrive, they take one core at most
        self._pool = pool or CompilePool(workers=1, capacity=4, name="gateway-grammar")
        self._entries = entries
        self._lock = threading.RLock()  # the outcomes are written by pool threads
        self._outcomes: OrderedDict[tuple[str, bytes], GrammarError | None] = OrderedDict()
        self._compiling: dict[tuple[str, bytes], tuple[Future, threading.Event]] = {}
        self._vocabulary_source = vocabulary
        self._vocabulary: Future | None = None  # what vocabulary() gave, or None; loaded on the first check

    async def check(self, kind: str, source: str, timeout_s: float) -> None:
        """Return if the constraint compiles; raise GrammarError (or its subclasses) saying why not."""
        key = constraint_key(kind, source)
        if self._known(key):
            return
        vocabulary = await asyncio.wrap_future(self._loaded())
        with self._lock:
            if self._known(key):  # compiled while the vocabulary loaded
                return
            running = self._compiling.get(key)
            if running is None:
                running = self._pool.submit(self._compile, key, source, timeout_s, vocabulary)
                self._compiling[key] = running
        future, started = running
        try:
            outcome = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:  # the compile goes on for whoever else awaits it, and leaves its outcome here
            raise timed_out(future, started, timeout_s, cancel=False) from None
        if outcome is not None:
            raise outcome

    def _known(self, key: tuple[str, bytes]) -> bool:
        """True if the constraint was checked before and compiles; raises its error if it did not."""
        with self._lock:
            if key not in self._outcomes:
                return False
            self._outcomes.move_to_end(key)
            outcome = self._outcomes[key]
        if outcome is not None:
            raise outcome
        return True

    def _loaded(self) -> Future:
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = Future()
                threading.Thread(target=self._load, name="gateway-vocabulary", daemon=True).start()
            return self._vocabulary

    def _load(self) -> None:
        vocabulary = None
        if self._vocabulary_source is not None:
            try:
                vocabulary = self._vocabulary_source()
            except Exception:
                log.exception("structured outputs: the model's vocabulary did not load; the gateway checks "
                              "constraints without it")
        self._vocabulary.set_result(vocabulary)

    def _compile(self, key: tuple[str, bytes], source: str, timeout_s: float, vocabulary) -> GrammarError | None:
        started = time.perf_counter()
        try:
            if vocabulary is None:
                build_grammar(key[0], source)
            else:  # what a worker will do (and more than llguidance's validation checks)
                compile_matcher(vocabulary.tokenizer, key[0], source, vocabulary.stop_token_ids)
            outcome = None
        except GrammarError as err:
            outcome = err
        except Exception as err:  # whatever else fails, the constraint is not enforceable: refused, not passed
            outcome = GrammarError(f"the {key[0]} constraint does not compile: {err}")
        elapsed = time.perf_counter() - started
        if outcome is None and elapsed > timeout_s:
            outcome = GrammarTooComplexError(f"compiling the {key[0]} constraint took {elapsed:.1f} s, longer than "
                                             f"the limit of {timeout_s:g} s")
        with self._lock:
            self._compiling.pop(key, None)
            self._outcomes[key] = outcome
            if len(self._outcomes) > self._entries:
                self._outcomes.popitem(last=False)
        return outcome
