"""contracts.compile_processes: one key's compiles wait their turn, in order, behind its running one; past its queue
or past the time limit the waiter gets the 429 at once; a waiter whose requester leaves, or whose server closes,
leaves its queue at once; a cached constraint never waits; other keys never wait behind a key.

The children are real processes on real pipes, but a stand-in for the compiler (FAKE_CHILD, the same protocol):
a regex source "gate:PATH" compiles until the test creates PATH, so that a compile lasts exactly as long as the
test needs; each child logs the start and end of every compile to one file, which says the order they ran in."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from contracts.compile_processes import CompileCancelled, CompileProcesses
from contracts.grammar import GrammarBusyError, GrammarOwnerBusyError
from contracts.grammar_compile import GatewayCheck
from edge.api import structured as structured_request
from edge.api.openai_request import ApiError, GenerateRequest
from edge.api.sampling_request import SamplingRequest

CHECKS = structured_request.GrammarChecks()  # the gateway's compile processes, as edge.state.GRAMMAR_CHECKS holds them


def check_structured(request, timeout_s=None, **kwargs):
    return structured_request.check_structured(request, CHECKS, timeout_s, **kwargs)


FAKE_CHILD = r"""
import json, os, sys, time
log = sys.argv[1]
def note(text):
    with open(log, "a") as out:
        out.write(text + "\n")
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    source = request["source"]
    note("start " + source)
    if source.startswith("gate:"):
        while not os.path.exists(source[5:]):
            time.sleep(0.005)
    note("end " + source)
    print(json.dumps({"grammar": "g:" + source} if request["mode"] == "grammar" else {}), flush=True)
"""
LONG_S = 30.0  # a gated compile's limit: the test releases it long before


class Bench:
    """Compile processes running FAKE_CHILD, and the gates and log of their compiles."""

    def __init__(self, tmp_path: Path, **options) -> None:
        self.dir, self.log = tmp_path, tmp_path / "compiles.log"
        self.log.touch()
        self.processes = CompileProcesses(**{"workers": 2, "per_owner": 1, **options})
        self.processes._argv = [sys.executable, "-c", FAKE_CHILD, str(self.log)]
        self.pool = ThreadPoolExecutor(16)
        self.gates: list[str] = []

    def gate(self, name: str) -> str:
        self.gates.append(f"gate:{self.dir / name}")
        return self.gates[-1]

    def release(self, source: str) -> None:
        Path(source.removeprefix("gate:")).touch()

    def run(self, source: str, owner: str | None = "key:a", timeout_s: float = LONG_S,
            cancelled: threading.Event | None = None) -> Future:
        return self.pool.submit(self.processes.run, "regex", source, timeout_s, "grammar", owner, cancelled)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def started(self, source: str) -> bool:
        return f"start {source}" in self.lines()

    def queued(self) -> int:
        return self.processes.state()["queued"]

    def close(self) -> None:
        for gate in self.gates:  # a compile a failed test left gated ends too
            self.release(gate)
        self.processes.close()
        self.pool.shutdown(wait=True, cancel_futures=True)


def until(condition, timeout_s: float = 60.0) -> None:
    """Await a condition of the processes or the log (polled: they have no event to await). The deadline is only how
    long a failing test takes: generous, for a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


@pytest.fixture()
def bench(tmp_path):
    benches = []

    def make(**options) -> Bench:
        benches.append(Bench(tmp_path, **options))
        return benches[-1]
    yield make
    for made in benches:
        made.close()


def test_two_concurrent_compiles_of_one_key_both_succeed_in_order(bench):
    b = bench()
    b.processes.warm()
    until(lambda: b.processes.state()["idle"] == 2)
    first = b.gate("first")
    running = b.run(first)
    until(lambda: b.started(first))
    second = b.run("second")
    until(lambda: b.queued() == 1)  # waiting its turn, though a process is idle
    assert b.processes.state()["idle"] == 1 and not second.done()
    b.release(first)
    assert running.result(20) == f"g:{first}" and second.result(20) == "g:second"
    assert b.lines() == [f"start {first}", f"end {first}", "start second", "end second"]
    assert b.queued() == 0 and b.processes._owners == {}


def test_an_honest_clients_parallel_compiles_all_succeed(bench):
    """Eight at once from one key, each a few milliseconds: no 429, each answered."""
    b = bench()
    sources = [f"quick-{i}" for i in range(8)]
    futures = [b.run(source) for source in sources]
    assert [future.result(30) for future in futures] == [f"g:{source}" for source in sources]
    starts = [line for line in b.lines() if line.startswith("start")]
    assert sorted(starts) == sorted(f"start {source}" for source in sources)


def test_the_waiter_past_the_queue_is_refused_at_once(bench):
    b = bench(queue_per_owner=2)
    first = b.gate("first")
    running = b.run(first)
    until(lambda: b.started(first))
    waiting = [b.run("second"), b.run("third")]
    until(lambda: b.queued() == 2)
    started = time.monotonic()
    with pytest.raises(GrammarOwnerBusyError, match="1 structured-output compile.s. running and 2 waiting"):
        b.run("fourth").result(20)
    # at once: waiting instead would take the first's whole LONG_S (it is gated), so 10 s still catches it
    assert time.monotonic() - started < 10.0 and b.queued() == 2
    b.release(first)
    assert running.result(20) == f"g:{first}"
    assert [future.result(20) for future in waiting] == ["g:second", "g:third"]
    assert "start fourth" not in b.lines()


def test_a_wait_past_the_time_limit_is_a_429_and_the_running_compile_goes_on(bench):
    b = bench()
    first = b.gate("first")
    running = b.run(first)
    until(lambda: b.started(first))
    started = time.monotonic()
    with pytest.raises(GrammarOwnerBusyError, match="did not end within the limit of 0.3 s"):
        b.run("second", timeout_s=0.3).result(20)
    # the limit and its margin (0.8 s), then the 429; a wait that ignored the limit would last until the gated first
    # ends (never, here), so 15 s still catches it on a busy machine
    assert 0.3 <= time.monotonic() - started < 15.0 and b.queued() == 0
    b.release(first)
    assert running.result(20) == f"g:{first}" and b.processes.killed == 0


def test_a_waiter_whose_requester_goes_away_leaves_the_queue(bench):
    b = bench()
    first = b.gate("first")
    running = b.run(first)
    until(lambda: b.started(first))
    gone = threading.Event()
    leaving = b.run("leaving", cancelled=gone)
    until(lambda: b.queued() == 1)
    staying = b.run("staying")
    until(lambda: b.queued() == 2)
    gone.set()
    with pytest.raises(CompileCancelled):
        leaving.result(5)
    assert b.queued() == 1
    b.release(first)
    assert running.result(20) == f"g:{first}" and staying.result(20) == "g:staying"
    assert "start leaving" not in b.lines() and b.processes.killed == 0


def test_closing_ends_the_waiters_at_once_with_a_terminal_error(bench):
    """What SIGTERM does in the gateway: the key's running compile and its waiters all end now, busy (a 503)."""
    b = bench()
    first = b.gate("first")
    running = b.run(first)
    until(lambda: b.started(first))
    waiters = [b.run(f"waiter-{i}") for i in range(3)]
    until(lambda: b.queued() == 3)
    started = time.monotonic()
    b.processes.close()
    for future in (running, *waiters):
        with pytest.raises(GrammarBusyError, match="shutting down"):
            future.result(15)
    # at once; a close that let the running compile (gated) or its waiters finish would never end, one that left
    # them to their LONG_S limit would take 30 s: 10 s still catches both on a busy machine
    assert time.monotonic() - started < 10.0 and b.queued() == 0
    with pytest.raises(GrammarBusyError, match="shutting down"):  # and nothing new waits
        b.run("late").result(5)


def test_another_key_does_not_wait_behind_a_keys_queue(bench):
    b = bench()
    first = b.gate("first")
    running = b.run(first)
    until(lambda: b.started(first))
    waiting = b.run("second")
    until(lambda: b.queued() == 1)
    assert b.run("other-key", owner="key:b").result(20) == "g:other-key"
    assert not running.done() and not waiting.done()
    b.release(first)
    assert waiting.result(20) == "g:second"


def test_the_queues_of_all_keys_together_are_bounded(bench):
    """Many owners (client addresses without keys) cannot grow the waiting without bound: past max_waiting, an owner
    with two fewer waiting than the longest queue takes its last place (that waiter: a 503), else it is the 503."""
    b = bench(max_waiting=2)
    b.processes.warm()  # both processes up: no caller waits for one to start
    until(lambda: b.processes.state()["idle"] == 2)
    gates = [b.gate("a"), b.gate("b")]
    running = [b.run(gates[0], owner="key:a"), b.run(gates[1], owner="key:b")]
    until(lambda: b.started(gates[0]) and b.started(gates[1]))
    waiting = [b.run("a-second", owner="key:a")]
    until(lambda: b.queued() == 1)
    waiting.append(b.run("a-third", owner="key:a"))
    until(lambda: b.queued() == 2)
    with pytest.raises(GrammarBusyError, match="2 structured-output compiles are waiting") as refused:
        b.run("a-fourth", owner="key:a").result(20)  # the longest queue is its own
    assert not isinstance(refused.value, GrammarOwnerBusyError)  # the server's load, not the client's: a 503
    waiting.append(b.run("b-second", owner="key:b"))  # key a has two more waiting: its last gives way
    with pytest.raises(GrammarBusyError, match="this client has the most of them"):
        waiting[1].result(20)
    with pytest.raises(GrammarBusyError, match="2 structured-output compiles are waiting"):
        b.run("b-third", owner="key:b").result(20)  # one each now: nobody gives way
    assert b.queued() == 2
    for gate in gates:
        b.release(gate)
    assert [future.result(20) for future in running] == [f"g:{gate}" for gate in gates]
    assert waiting[0].result(20) == "g:a-second" and waiting[2].result(20) == "g:b-second"


def test_the_gateway_check_never_queues_a_cached_constraint_and_drops_a_cancelled_waiter(bench):
    b = bench()
    check = GatewayCheck(b.processes)

    async def scenario():
        await check.check("regex", "cached", LONG_S, "key:a")  # compiled once: its outcome is kept
        first = b.gate("first")
        running = asyncio.ensure_future(check.check("regex", first, LONG_S, "key:a"))
        await asyncio.to_thread(until, lambda: b.started(first))
        started = time.monotonic()
        await check.check("regex", "cached", LONG_S, "key:a")  # while the key's compile runs: no wait
        cached_s = time.monotonic() - started
        leaving = asyncio.ensure_future(check.check("regex", "leaving", LONG_S, "key:a"))
        await asyncio.to_thread(until, lambda: b.queued() == 1)
        leaving.cancel()  # the client went away: the waiting compile leaves the queue
        await asyncio.to_thread(until, lambda: b.queued() == 0)  # else it waits its turn: the gated first's end
        assert not running.done()
        b.release(first)
        await running
        return cached_s
    # no wait: waiting its turn would last until the gated first ends (after this), so 5 s still catches it
    assert asyncio.run(scenario()) < 5.0
    assert b.lines().count("start cached") == 1 and "start leaving" not in b.lines()


def test_the_gateway_answers_a_full_queue_with_a_429_and_takes_the_configured_queue(bench, monkeypatch):
    """check_structured: with grammar_compile_queue_per_key = 0 a key's second concurrent compile is the 429 at once
    (Retry-After: 1); with 1 it waits its turn and passes."""
    b = bench()
    monkeypatch.setitem(CHECKS.checks, None, GatewayCheck(b.processes))

    def request(source: str) -> GenerateRequest:
        return GenerateRequest("chat", "m", SamplingRequest(structured=("regex", source)), False, False, None,
                               structured_param="guided_regex")

    async def scenario():
        first = b.gate("first")
        running = asyncio.ensure_future(check_structured(request(first), LONG_S, owner="key:a"))
        await asyncio.to_thread(until, lambda: b.started(first))
        with pytest.raises(ApiError) as refused:
            await check_structured(request("refused"), LONG_S, owner="key:a", queue_per_key=0)
        waiting = asyncio.ensure_future(check_structured(request("waiting"), LONG_S, owner="key:a",
                                                         queue_per_key=1))
        await asyncio.to_thread(until, lambda: b.queued() == 1)
        b.release(first)
        await asyncio.gather(running, waiting)
        return refused.value
    error = asyncio.run(scenario())
    assert (error.status, error.code, error.param) == (429, "structured_output_compiles_per_key", "guided_regex")
    assert error.headers == {"Retry-After": "1"} and "1 structured-output compile(s) running" in error.message
    assert b.lines()[-2:] == ["start waiting", "end waiting"] and "start refused" not in b.lines()


def test_six_keys_flooding_slow_compiles_cannot_fail_a_seventh_keys_small_ones(bench):
    """Issue 48: six keys keep both processes busy with slow compiles and fill every waiting place; a seventh key's
    five small compiles, sent at once, take places from the longest queues (those waiters get a 503), then each
    takes the next process that comes free (its key has compiled least lately) and all succeed."""
    b = bench(queue_per_owner=8, max_waiting=40)  # 6 keys x 9 callers overfill it
    callers = ThreadPoolExecutor(64)  # every flood caller blocks a thread while it waits

    def run(source: str, owner: str, timeout_s: float = LONG_S) -> Future:
        return callers.submit(b.processes.run, "regex", source, timeout_s, "grammar", owner)
    floods = [f"key:flood{i}" for i in range(6)]
    firsts = [b.gate(f"flood{i}-first") for i in range(6)]
    first_runs = [run(gate, owner) for gate, owner in zip(firsts, floods)]
    seen: dict[str, float] = {}

    def hold_firsts() -> bool:
        """Each flood key's first compile lasts HOLD_S: its key's usage then stays far above what the seventh key's
        five small compiles add up to, however slowly a busy machine runs them (they go first as the least used)."""
        for gate in firsts:
            if b.started(gate) and time.monotonic() - seen.setdefault(gate, time.monotonic()) >= HOLD_S:
                b.release(gate)
        return all(f.done() for f in first_runs)
    until(hold_firsts)
    assert [f.result() for f in first_runs] == [f"g:{gate}" for gate in firsts]  # every flood key has compiled
    gates = [b.gate(f"flood{i}-{j}") for j in range(9) for i in range(6)]
    flooding = [run(gate, floods[i % 6]) for i, gate in enumerate(gates)]
    until(lambda: b.processes.state()["waiting"] + b.processes.state()["queued"] == b.processes.max_waiting
          and sum(map(b.started, gates)) == 2 and sum(future.done() for future in flooding) == len(gates) - 42)
    holding = [gate for gate in gates if b.started(gate)]
    # LONG_S: five in turn on one process, each behind the last, can pass a few seconds on a busy machine (5 s was
    # missed by 5 ms); starved behind the floods they would wait for gates that open only below, past result(20)
    small = [run(f"small-{k}", "key:seventh") for k in range(5)]
    until(lambda: len(b.processes._owners.get("key:seventh", _Nobody).waiting) == 5)
    assert b.processes.state()["waiting"] + b.processes.state()["queued"] == b.processes.max_waiting
    b.release(holding[0])  # one slow compile ends: its process goes to the seventh key, which keeps it
    assert [future.result(20) for future in small] == [f"g:small-{k}" for k in range(5)]
    lines = b.lines()
    after = lines[lines.index(f"end {holding[0]}") + 1:]
    assert after[:10] == [f"{step} small-{k}" for k in range(5) for step in ("start", "end")]
    for gate in gates:
        b.release(gate)
    outcomes = []
    for future in flooding:
        try:
            outcomes.append(future.result(20))
        except GrammarBusyError:  # a flood's surplus: refused at once, or its place given to the seventh key
            outcomes.append("busy")
    assert outcomes.count("busy") == len(gates) - 42 + 5  # 2 ran, 40 waited, 5 of them gave way
    callers.shutdown()


HOLD_S = 1.0


class _Nobody:
    waiting = ()
