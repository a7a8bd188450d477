"""Where structured-output compiles run: off the caller's thread (the gateway's event loop, the prefill thread, the
engine thread), a bounded number at once, each under the compile time limit (grammar_compile_timeout_s).

A compile past its limit is abandoned, not stopped (a thread cannot be): it keeps its slot until it ends, so
abandoned compiles cannot pile up; with every slot taken a new compile is refused at once (GrammarBusyError, a 503)
rather than queued behind them. llguidance's own work limits (contracts.grammar.limits) end every compile.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from contracts.grammar import (
    DEFAULT_COMPILE_TIMEOUT_S,
    GrammarBusyError,
    GrammarError,
    GrammarTooComplexError,
    build_grammar,
)


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


class GatewayCheck:
    """The gateway's check of a constraint before it admits the request: compiled (without a vocabulary: the
    schema's keywords, the regexes, the grammar's size) in the pool, awaited at most the time limit. The outcome is
    kept per constraint (clients repeat theirs); requests with a constraint still compiling await the same compile.
    A compile that ends past the limit is remembered as too complex, so that a later request with it is refused at
    once instead of reaching a worker whose own compile would time out."""

    def __init__(self, pool: CompilePool | None = None, entries: int = 256) -> None:
        self._pool = pool or CompilePool(workers=2, capacity=8, name="gateway-grammar")
        self._entries = entries
        self._lock = threading.Lock()  # the outcomes are written by pool threads
        self._outcomes: OrderedDict[tuple[str, str], GrammarError | None] = OrderedDict()
        self._compiling: dict[tuple[str, str], tuple[Future, threading.Event]] = {}

    async def check(self, kind: str, source: str, timeout_s: float) -> None:
        """Return if the constraint compiles; raise GrammarError (or its subclasses) saying why not."""
        key = (kind, source)
        with self._lock:
            if key in self._outcomes:
                self._outcomes.move_to_end(key)
                outcome = self._outcomes[key]
                if outcome is not None:
                    raise outcome
                return
            running = self._compiling.get(key)
            if running is None:
                running = self._pool.submit(self._compile, key, timeout_s)
                self._compiling[key] = running
        future, started = running
        try:
            outcome = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:  # the compile goes on for whoever else awaits it, and leaves its outcome here
            raise timed_out(future, started, timeout_s, cancel=False) from None
        if outcome is not None:
            raise outcome

    def _compile(self, key: tuple[str, str], timeout_s: float) -> GrammarError | None:
        started = time.perf_counter()
        try:
            build_grammar(*key)
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
