"""Structured-output compiles are cached per cache salt (one per API key or group: edge.core.cache_salt): a schema one
tenant compiled is compiled again for another, never answered from the first's outcome or joined to its compile
in flight, so no tenant can time whether another sent a schema; the same salt hits as before. The gateway's check
(GatewayCheck), the workers' and the engine's compiled grammars (CompiledGrammars), the engine's matcher of a
sequence (its handoff's salt), and /health's count of the gateway's compiles.

Compiles are counted, not timed: the gateway's through a stand-in for its compile processes, the workers' through
a stand-in for the compiler."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from contracts import grammar_compile
from contracts.grammar import GrammarTooComplexError
from contracts.grammar_compile import CompiledGrammars, CompilePool, GatewayCheck
from contracts.handoff import SamplingParams
from edge.api import structured as structured_request
from edge.api.openai_request import GenerateRequest
from edge.api.sampling_request import SamplingRequest
from fake_runner import fake_handoff, make_engine

CHECKS = structured_request.GrammarChecks()  # the gateway's compile processes, as edge.state.GRAMMAR_CHECKS holds them


def check_structured(request, timeout_s=None, **kwargs):
    return structured_request.check_structured(request, CHECKS, timeout_s, **kwargs)


SCHEMA = '{"type": "object", "properties": {"secret_field": {"type": "string"}}}'
WAIT_S = 20.0


class CountingProcesses:
    """CompileProcesses' interface to GatewayCheck: counts the compiles sent; "explosive" is too complex; a source
    in `gates` compiles until its event is set."""

    def __init__(self) -> None:
        self.sources: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.started = threading.Semaphore(0)  # released as each compile starts

    def run(self, kind, source, timeout_s, mode="check", owner=None, cancelled=None) -> str:
        self.sources.append(source)
        self.started.release()
        if source in self.gates:
            assert self.gates[source].wait(WAIT_S)
        if source == "explosive":
            raise GrammarTooComplexError("compiling the constraint took longer than the limit of 5 s")
        return ""

    def state(self) -> dict:
        return {"idle": 0, "compiling": 0, "waiting": 0, "queued": 0, "stopped": 0, "compiles": len(self.sources)}

    def close(self) -> None:
        pass


def test_a_schema_one_salt_checked_is_checked_again_for_another_and_kept_for_each():
    processes = CountingProcesses()
    check = GatewayCheck(processes)

    async def scenario():
        await check.check("json_schema", SCHEMA, 5.0, "key:a", "salt-a")
        await check.check("json_schema", SCHEMA, 5.0, "key:b", "salt-b")  # another tenant: a miss, compiled again
        assert processes.sources == [SCHEMA, SCHEMA]
        await check.check("json_schema", SCHEMA, 5.0, "key:a", "salt-a")  # each salt's own repeat: a hit
        await check.check("json_schema", SCHEMA, 5.0, "key:b", "salt-b")
        await check.check("json_schema", SCHEMA, 5.0, "key:a2", "salt-a")  # a key of the same group (salt): a hit
    asyncio.run(scenario())
    assert processes.sources == [SCHEMA, SCHEMA]


def test_a_refusal_is_kept_per_salt_too():
    """Another tenant's schema that was too complex is not refused at once (that would say it was sent)."""
    processes = CountingProcesses()
    check = GatewayCheck(processes)

    async def refused(owner: str, salt: str) -> None:
        with pytest.raises(GrammarTooComplexError):
            await check.check("json_schema", "explosive", 5.0, owner, salt)
    asyncio.run(refused("key:a", "salt-a"))
    asyncio.run(refused("key:b", "salt-b"))
    asyncio.run(refused("key:a", "salt-a"))
    assert processes.sources == ["explosive", "explosive"]


def test_a_compile_in_flight_is_joined_by_its_own_salt_only():
    """Of one owner (key) too: a client's own cache_salt narrows its key's salt, and then its compile is its own."""
    processes = CountingProcesses()
    gate = processes.gates[SCHEMA] = threading.Event()
    check = GatewayCheck(processes)

    async def scenario():
        first = asyncio.ensure_future(check.check("json_schema", SCHEMA, 5.0, "key:a", "salt-a"))
        assert await asyncio.to_thread(processes.started.acquire, timeout=WAIT_S)
        joined = asyncio.ensure_future(check.check("json_schema", SCHEMA, 5.0, "key:a", "salt-a"))
        narrowed = asyncio.ensure_future(check.check("json_schema", SCHEMA, 5.0, "key:a", "salt-a-narrowed"))
        other = asyncio.ensure_future(check.check("json_schema", SCHEMA, 5.0, "key:b", "salt-b"))
        for _ in range(2):  # the narrowed salt's compile and the other tenant's start while the first still runs
            assert await asyncio.to_thread(processes.started.acquire, timeout=WAIT_S)
        assert len(processes.sources) == 3 and not first.done()
        gate.set()
        await asyncio.gather(first, joined, narrowed, other)
    asyncio.run(scenario())
    assert processes.sources == [SCHEMA] * 3


@pytest.fixture()
def counted_compiles(monkeypatch):
    """The workers' compiler replaced by a stand-in that counts (kind, source) compiles; a source in `gates`
    compiles until its event is set."""
    compiled: list[tuple[str, str]] = []
    gates: dict[str, threading.Event] = {}

    def compile_matcher(tokenizer, kind, source, stops):
        compiled.append((kind, source))
        if source in gates:
            assert gates[source].wait(WAIT_S)
        return types.SimpleNamespace(copy=lambda: object())
    monkeypatch.setattr(grammar_compile, "compile_matcher", compile_matcher)
    return types.SimpleNamespace(compiled=compiled, gates=gates)


def grammars(entries: int = 64) -> CompiledGrammars:
    return CompiledGrammars(lambda: None, (0,), 5.0, CompilePool(workers=2, capacity=8, name="test-grammar"),
                            entries)


def test_the_workers_grammars_are_kept_per_salt(counted_compiles):
    kept = grammars()
    first = kept.matcher("json_schema", SCHEMA, "salt-a")
    assert kept.matcher("json_schema", SCHEMA, "salt-b") is not first
    assert counted_compiles.compiled == [("json_schema", SCHEMA)] * 2  # each salt missed once
    kept.matcher("json_schema", SCHEMA, "salt-a")
    kept.matcher("json_schema", SCHEMA, "salt-b")
    assert len(counted_compiles.compiled) == 2  # and then hit
    assert kept.prepare("json_schema", SCHEMA, "salt-c") is not kept.prepare("json_schema", SCHEMA, "salt-a")


def test_the_workers_compile_in_flight_is_not_shared_between_salts(counted_compiles):
    schema = SCHEMA.replace("secret_field", "in_flight_field")  # this test's own: no other test's compile counts
    gate = counted_compiles.gates[schema] = threading.Event()
    kept = grammars()
    running = kept.prepare("json_schema", schema, "salt-a")
    assert kept.prepare("json_schema", schema, "salt-a") is running
    other = kept.prepare("json_schema", schema, "salt-b")
    assert other is not running
    gate.set()
    running.result(WAIT_S), other.result(WAIT_S)
    assert counted_compiles.compiled.count(("json_schema", schema)) == 2, counted_compiles.compiled


def test_the_workers_grammars_stay_bounded_over_salts(counted_compiles):
    kept = grammars(entries=2)
    for salt in ("salt-a", "salt-b", "salt-c"):
        kept.matcher("json_schema", SCHEMA, salt)
    assert len(kept._compiled) == 2
    kept.matcher("json_schema", SCHEMA, "salt-a")  # the least recently used was let go: compiled again
    assert len(counted_compiles.compiled) == 4


def test_the_engine_asks_for_each_choices_matcher_with_its_handoffs_salt():
    engine, _ = make_engine()
    asked: list[tuple[str, str, str]] = []

    class Grammars:
        def matcher(self, kind, source, cache_salt=""):
            asked.append((kind, source, cache_salt))
            return types.SimpleNamespace(accept_token=lambda token: True)
    engine.sampler.matchers._grammars = Grammars()
    handoff = fake_handoff("r", [5, 6, 7], 4)
    sampling = SamplingParams(max_tokens=4, structured=("json_schema", SCHEMA), n=2)
    other = dataclasses.replace(handoff.first_tokens[0], token=handoff.first_token + 1)
    engine.add(dataclasses.replace(handoff, sampling=sampling, cache_salt="salt-a", other_choices=(other,)))
    assert asked == [("json_schema", SCHEMA, "salt-a")] * 2


def test_check_structured_keeps_outcomes_per_salt_and_health_counts_the_compiles(monkeypatch):
    """The route's check (edge.api.structured) passes the request's salt on; /health's
    structured_outputs.compiles is what an end-to-end test reads to tell a miss from a hit."""
    processes = CountingProcesses()
    monkeypatch.setitem(CHECKS.checks, None, GatewayCheck(processes))
    request = GenerateRequest("chat", "m", SamplingRequest(structured=("json_schema", SCHEMA)), False, False, None,
                              structured_param="response_format")
    for owner, salt in (("key:a", "salt-a"), ("key:b", "salt-b"), ("key:a", "salt-a")):
        asyncio.run(check_structured(request, 5.0, owner=owner, cache_salt=salt))
    assert CHECKS.state()["compiles"] == 2


def test_the_real_compile_processes_count_what_they_compile():
    from contracts.compile_processes import CompileProcesses
    processes = CompileProcesses(workers=1)
    check = GatewayCheck(processes)
    try:
        for salt in ("salt-a", "salt-b", "salt-a"):
            asyncio.run(check.check("regex", "[a-z]+", 30.0, "key:x", salt))
        with ThreadPoolExecutor(1) as pool:  # state() from another thread, as /health reads it
            assert pool.submit(processes.state).result()["compiles"] == 2
    finally:
        check.close()
