"""contracts.grammar (llguidance) and contracts.grammar_compile: every kind compiles; what the engine cannot
enforce is an error naming it (fail closed); $defs and $ref work; compiles are bounded in number and in time; the
gateway's check answers 400/503 with the right codes while other requests go on."""

import asyncio
import json
import threading
import time

import pytest

from contracts.compile_processes import CompileProcesses
from contracts.grammar import (
    GrammarBusyError,
    GrammarError,
    GrammarTooComplexError,
    build_grammar,
    compile_matcher,
    grammar_text,
)
from contracts.grammar_compile import CompilePool, GatewayCheck, compile_timeout_s
from edge.api import structured as structured_request
from edge.api.openai_request import ApiError, GenerateRequest
from edge.api.sampling_request import SamplingRequest

CHECKS = structured_request.GrammarChecks()  # the gateway's compile processes, as edge.state.GRAMMAR_CHECKS holds them


def check_structured(request, timeout_s=None, **kwargs):
    return structured_request.check_structured(request, CHECKS, timeout_s, **kwargs)



def refusal(kind: str, source: str) -> str:
    with pytest.raises(GrammarError) as caught:
        build_grammar(kind, source)
    return str(caught.value)


@pytest.mark.parametrize("kind, source", [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
    ("json_object", ""),
    ("regex", "[0-9]{1,3}"),
    ("choice", json.dumps(["yes", "no"])),
    ("grammar", 'root ::= "a" digit+\ndigit ::= [0-9]'),  # llama.cpp's GBNF, converted to Lark
    ("grammar", 'start: "a" DIGIT+\nDIGIT: /[0-9]/'),  # Lark
])
def test_every_kind_compiles(kind, source):
    assert build_grammar(kind, source)


@pytest.mark.parametrize("schema, named", [
    ({"not": {"type": "string"}}, '["not"]'),
    ({"type": "array", "uniqueItems": True}, '["uniqueItems"]'),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, '["dependentRequired"]'),
    ({"type": "string", "format": "bogus"}, "Unknown format: bogus"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),  # overlapping branches: not enforceable
    ({"$ref": "http://example.com/schema.json"}, "http://example.com/schema.json"),
])
def test_a_keyword_the_engine_does_not_enforce_is_refused_by_name(schema, named):
    message = refusal("json_schema", json.dumps(schema))
    assert named in message and message.startswith("the json_schema constraint")


def test_unsupported_keywords_say_they_are_refused_not_ignored():
    assert "refused, not ignored" in refusal("json_schema", json.dumps({"not": {}}))


def test_defs_and_refs_compile_as_instructor_sends_them():
    schema = {"$defs": {"Pet": {"type": "object", "properties": {"name": {"type": "string"}},
                                "required": ["name"]}},
              "type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
                                               "best": {"$ref": "#/$defs/Pet"}},
              "required": ["pets"]}
    assert build_grammar("json_schema", json.dumps(schema))
    # a discriminated union (pydantic writes oneOf + discriminator): the branches are disjoint, so it is enforced
    kinds = [{"type": "object", "properties": {"kind": {"const": k, "type": "string"}}, "required": ["kind"]}
             for k in ("cat", "dog")]
    union = {"$defs": {"Cat": kinds[0], "Dog": kinds[1]}, "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
             "discriminator": {"propertyName": "kind"}}
    assert build_grammar("json_schema", json.dumps(union))
    # branches that may overlap are refused, even under a discriminator (oneOf would pass what fits both)
    kinds[1]["properties"]["kind"] = {"type": "string"}
    assert "oneOf" in refusal("json_schema", json.dumps(union))


@pytest.mark.parametrize("kind, source, says", [
    ("regex", "a(b", "unclosed group"),
    ("grammar", 'root ::= "a" | missing', "missing"),
    ("grammar", "start: foo", "foo"),
    ("choice", "[]", "non-empty list"),
    ("json_schema", "{", "EOF"),
    ("json_schema", json.dumps({"type": 5}), "type must be a string"),
    ("bogus", "", "unknown structured output kind"),
])
def test_what_does_not_parse_is_a_grammar_error_saying_why(kind, source, says):
    assert says in refusal(kind, source)


def test_a_source_past_the_size_limit_is_too_complex():
    with pytest.raises(GrammarTooComplexError):
        grammar_text("regex", "a" * (256 * 1024 + 1))


def test_a_grammar_past_llguidances_size_limit_is_too_complex():
    """allOf over anyOfs multiplies out: llguidance stops at its grammar size limit, quickly."""
    schema = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {"type": "string"}}}
                                   for i in range(6)]} for j in range(6)]}
    started = time.perf_counter()
    with pytest.raises(GrammarTooComplexError) as caught:
        build_grammar("json_schema", json.dumps(schema))
    # 0.02 s on the dev machine; 10 s leaves a busy machine room and still catches a compile that multiplies out
    assert time.perf_counter() - started < 10.0 and caught.value.code == "structured_output_too_complex"


class Gate:
    """A compile that runs until the test lets it finish."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, *args):
        self.entered.set()
        assert self.release.wait(30)
        return "done"


def test_the_pool_times_a_compile_out_and_keeps_its_slot_until_it_ends():
    pool, gate = CompilePool(workers=1, capacity=1), Gate()
    with pytest.raises(GrammarTooComplexError, match="longer than the limit of 0.05 s"):
        pool.run(0.05, gate)
    with pytest.raises(GrammarBusyError):  # the abandoned compile still holds the only slot: refused at once
        pool.run(5.0, lambda: "next")
    gate.release.set()
    # the one worker runs this after the abandoned compile has ended and its slot come back (done callbacks first)
    pool._executor.submit(lambda: None).result(10)
    assert pool.run(5.0, lambda: "next") == "next"


def test_a_compile_that_waited_behind_others_is_busy_not_too_complex():
    pool, gate = CompilePool(workers=1, capacity=2), Gate()
    pool.submit(gate)
    assert gate.entered.wait(5)
    with pytest.raises(GrammarBusyError):
        pool.run(0.05, lambda: "queued")
    gate.release.set()


def test_the_timeout_comes_from_the_config_when_it_has_one():
    class Config:
        grammar_compile_timeout_s = 1.5
    assert compile_timeout_s(object(), Config()) == 1.5
    assert compile_timeout_s(object()) == 5.0


def request(schema) -> GenerateRequest:
    return GenerateRequest("chat", "m", SamplingRequest(structured=("json_schema", json.dumps(schema))), False, False, None,
                           structured_param="response_format")


async def refused(schema, timeout_s=5.0, owner=None) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await check_structured(request(schema), timeout_s, owner=owner)
    return caught.value


def explosive(k: int = 4, n: int = 9) -> dict:
    """allOf over k anyOfs of n objects with backtracking patterns: about a second of CPU before llguidance's size
    limit stops it (0.5 to 1 s on the dev machine), far past the limits these tests set."""
    return {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {
        "type": "string", "pattern": f"^(x+x+)+y{{{i},{i + 30}}}$"}}} for i in range(n)]} for j in range(k)]}


@pytest.fixture()
def processes(monkeypatch):
    """The gateway's check on real compile processes (grammars alone, no vocabulary: quick to start)."""
    check = GatewayCheck(CompileProcesses(workers=2, per_owner=1))
    monkeypatch.setitem(CHECKS.checks, None, check)
    yield check.processes
    check.close()


def test_the_gateway_answers_400_naming_the_keyword(processes):
    error = asyncio.run(refused({"type": "array", "uniqueItems": True}))
    assert (error.status, error.code, error.param) == (400, "invalid_structured_output", "response_format")
    assert "uniqueItems" in error.message
    asyncio.run(check_structured(request({"type": "object"}), 5.0))  # and passes what compiles


@pytest.mark.slow  # child processes started and killed: a few seconds
def test_a_slow_compile_is_killed_at_the_limit_and_remembered_while_others_go_on(processes):
    async def scenario():
        started = time.perf_counter()
        slow_check = asyncio.ensure_future(refused(explosive(), timeout_s=0.1))  # it needs 0.25 s idle
        other = time.perf_counter()
        await check_structured(request({"type": "object", "properties": {"x": {"type": "integer"}}}), 5.0)
        other_s = time.perf_counter() - other
        error = await slow_check
        return error, time.perf_counter() - started, other_s
    asyncio.run(check_structured(request({"type": "object"}), 5.0))  # both processes started
    error, slow_s, other_s = asyncio.run(scenario())
    assert (error.status, error.code) == (400, "structured_output_too_complex")
    assert "stopped" in error.message and processes.killed == 1  # killed at its limit, not let run to its end
    # Bounds for a busy machine, which runs both the compiles and this test late: the kill and its refusal well
    # before a compile left to its end on such a machine; the other compile never waits for a process to start.
    # (That one key's compiles never hold up another's is proven exactly, with gated compiles, by
    # test_compile_processes.py.)
    assert 0.1 <= slow_s < 5.0 and other_s < 5.0, (slow_s, other_s)
    compiles = processes.state()["compiles"]
    started = time.perf_counter()  # the same constraint again: refused at once, no process taken
    again = asyncio.run(refused(explosive(), timeout_s=0.1))
    assert again.code == "structured_output_too_complex" and processes.state()["compiles"] == compiles
    assert time.perf_counter() - started < 5.0 and processes.killed == 1


async def until(condition, timeout_s: float = 30.0) -> None:
    """Await a condition of the compile processes (polled: they have no event to await); fail past timeout_s (only
    how long a failing test takes: generous, for a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


@pytest.mark.slow
def test_a_client_that_goes_away_leaves_its_keys_queue_or_stops_its_compile_and_one_key_cannot_fill_the_pool(
        processes):
    """Key a's second compile waits its turn holding no process (key b's compile goes on meanwhile); its client
    leaving takes it out of the queue before it compiled; the first's client leaving kills its process at once."""
    async def scenario():
        processes.warm()
        await until(lambda: processes.state()["idle"] == 2, 60.0)
        leaving = asyncio.ensure_future(check_structured(request(explosive()), 5.0, owner="key:a"))
        await until(lambda: processes.state()["compiling"] == 1)
        waiting = asyncio.ensure_future(check_structured(request(explosive(4, 8)), 5.0, owner="key:a"))
        await until(lambda: processes.state()["queued"] == 1)
        assert processes.state()["idle"] == 1  # the waiting compile of key a holds no process
        compiles = processes.state()["compiles"]
        waiting.cancel()  # its client left: it leaves the queue, never compiled
        await until(lambda: processes.state()["queued"] == 0)
        # left while key a's first still compiles (not when its turn came), and never compiled: told by state, not
        # by a deadline that a busy machine could pass
        assert not leaving.done() and processes.state()["compiling"] == 1 and processes.killed == 0
        assert processes.state()["compiles"] == compiles
        leaving.cancel()  # the client left: its process is killed at once
        started = time.perf_counter()
        await until(lambda: processes.killed == 1)  # a compile left to run would end by itself: never killed
        return time.perf_counter() - started
    asyncio.run(check_structured(request({"type": "object"}), 5.0))
    assert asyncio.run(scenario()) < 5.0  # at once; its 5 s limit would kill it only later
    # another key still compiles, and neither cancelled constraint is remembered as anything
    asyncio.run(check_structured(request({"type": "object", "properties": {"b": {"type": "string"}}}), 5.0,
                                 owner="key:b"))
    asyncio.run(until(lambda: processes.state()["queued"] == 0 and processes._owners == {}))


def test_no_free_process_within_the_limit_is_a_503(monkeypatch):
    check = GatewayCheck(CompileProcesses(workers=0))  # none will ever come free
    monkeypatch.setitem(CHECKS.checks, None, check)
    busy = asyncio.run(refused({"type": "object", "title": "another"}, timeout_s=0.1))
    assert (busy.status, busy.code, busy.headers) == (503, "structured_output_busy", {"Retry-After": "1"})


def product_of_unions(k: int, n: int) -> dict:
    """allOf over k anyOfs of n objects: llguidance multiplies it out into n**k alternatives."""
    return {"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{j}_{i}": {"type": "string"}}}
                                 for i in range(n)]} for j in range(k)]}


@pytest.mark.slow
def test_the_gateway_compiles_over_the_vocabulary_as_the_workers_do(embedded_model_path):
    """The gateway's check builds the very matcher a worker will (llguidance's validation alone has passed grammars
    whose matcher then failed to build): what it passes, a worker compiles; what the worker cannot, it refuses."""
    from prefill_cpu.grammar import GGUFVocabulary
    check = GatewayCheck(CompileProcesses(1, 1, "prefill_cpu.grammar:GGUFVocabulary", embedded_model_path))
    with pytest.raises(GrammarTooComplexError, match="too complex"):
        asyncio.run(check.check("json_schema", json.dumps(product_of_unions(5, 5)), 60.0))
    passing = json.dumps(product_of_unions(3, 3))
    asyncio.run(check.check("json_schema", passing, 60.0))
    check.close()
    vocabulary = GGUFVocabulary(embedded_model_path)
    assert compile_matcher(vocabulary.tokenizer, "json_schema", passing, vocabulary.stop_token_ids)


@pytest.mark.slow
def test_closing_stops_a_compile_in_progress_at_once():
    """What SIGTERM does in the gateway: a compile running when the processes close ends now, busy (a 503)."""
    processes = CompileProcesses(workers=1)
    processes.run("regex", "[0-9]+", 5.0)  # the process is up
    closed_at = []

    def close_while_compiling() -> None:  # not after a fixed delay: a busy machine may start the compile late
        deadline = time.monotonic() + 30.0
        while processes.state()["compiling"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        closed_at.append(time.perf_counter())
        processes.close()
    closer = threading.Thread(target=close_while_compiling, daemon=True)
    closer.start()
    # a limit of 30 s: a compile left to end by itself is too complex, not busy; one left to its limit takes 30 s
    with pytest.raises(GrammarBusyError, match="shutting down"):
        processes.run("json_schema", json.dumps(explosive()), 30.0)
    ended_s = time.perf_counter() - closed_at[0]
    closer.join(5)
    assert ended_s < 10.0 and processes.state()["stopped"] == 1
