"""The decode engine's failure isolation and memory bounds, on the fake runner: per-sequence failures, the
handoff backlog, swap space, and the bounded per-gateway event queue (over a real socket and handshake)."""

import asyncio
import math
import random
import threading
import time

import pytest

from contracts.events import FinishReason, TokenEvent
from contracts.framing import connect_when_listening, read_message, send_message, start_server
from contracts.handoff import encode_handoff
from contracts.messages import Abort, DecodeYield, Handoff, Token
from decode_gpu.engine import DecodeEngine, HandoffRejectedError
from decode_gpu.service.server import EngineService
from fake_runner import FakeRunner, expected_tokens, fake_handoff, make_engine

SECRET = b"engine-server-test"


def prompt_of(seed: int, n: int = 6) -> list[int]:
    return [3 + (seed * 31 + 7 * i) % 900 for i in range(n)]


def run_engine(engine: DecodeEngine, handoffs, max_steps=2_000) -> tuple[dict, dict]:
    """Add the handoffs, step to the end; returns (tokens, terminal event) per request."""
    tokens, endings = {}, {}

    def record(events):
        for event in events:
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finish_reason is not None:
                assert event.request_id not in endings, "two terminal events for one request"
                endings[event.request_id] = event

    for handoff in handoffs:
        record(engine.add(handoff))
    for _ in range(max_steps):
        if not engine.has_work:
            break
        record(engine.step())
        engine.blocks.check_integrity()
    assert not engine.has_work
    return tokens, endings


def assert_idle(engine: DecodeEngine, runner: FakeRunner) -> None:
    """Everything a request held is back: blocks, swap space, backlog bytes."""
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not runner.swap_space and engine.scheduler.num_swapped_blocks == 0
    assert engine.backlog.num_bytes == 0 and engine.stats().backlog_bytes == 0


# --- per-sequence failures ----------------------------------------------------------------------
def test_a_failed_import_fails_only_its_sequence():
    engine, runner = make_engine()
    runner.fail_import = {"bad"}
    prompts = {rid: prompt_of(i) for i, rid in enumerate(["a", "bad", "b"])}
    tokens, endings = run_engine(engine, [fake_handoff(rid, p, 8) for rid, p in prompts.items()])
    assert endings["bad"].finish_reason is FinishReason.ERROR
    assert "importing its KV handoff failed" in endings["bad"].error
    for rid in ("a", "b"):
        assert endings[rid].finish_reason is FinishReason.LENGTH and tokens[rid] == expected_tokens(prompts[rid], 8)
    assert_idle(engine, runner)


@pytest.mark.parametrize("poison, temperature, why", [(math.nan, 0.0, "NaN logits"),
                                                      (math.inf, 1.0, "sampling failed")])
def test_bad_logits_fail_only_their_sequence(poison, temperature, why):
    engine, runner = make_engine()
    runner.poison_logits = {"bad": poison}
    prompts = {rid: prompt_of(i) for i, rid in enumerate(["a", "bad", "b"])}
    handoffs = [fake_handoff(rid, p, 8, temperature=temperature if rid == "bad" else 0.0) for rid, p in prompts.items()]
    tokens, endings = run_engine(engine, handoffs)
    assert endings["bad"].finish_reason is FinishReason.ERROR and why in endings["bad"].error
    assert tokens["bad"] == expected_tokens(prompts["bad"], 1)  # the prefill worker's token, nothing more
    for rid in ("a", "b"):
        assert tokens[rid] == expected_tokens(prompts[rid], 8)
    assert_idle(engine, runner)


def test_a_failed_forward_fails_the_batch_and_the_engine_goes_on():
    engine, runner = make_engine()
    runner.num_forward_failures = 1
    for i, rid in enumerate(("a", "b")):
        engine.add(fake_handoff(rid, prompt_of(i), 8))
    events = engine.step()
    assert {e.request_id: e.finish_reason for e in events} == {"a": FinishReason.ERROR, "b": FinishReason.ERROR}
    assert all("decode step failed" in e.error for e in events)
    assert not engine.has_work
    assert_idle(engine, runner)
    tokens, endings = run_engine(engine, [fake_handoff("c", prompt_of(3), 8)])
    assert endings["c"].finish_reason is FinishReason.LENGTH and tokens["c"] == expected_tokens(prompt_of(3), 8)


# --- the handoff backlog ------------------------------------------------------------------------
def test_handoff_bytes_stay_in_the_backlog_until_imported():
    engine, runner = make_engine(num_blocks=8, block_size=4)  # room for the first only
    first, second = fake_handoff("first", prompt_of(1, 20), 4), fake_handoff("second", prompt_of(2, 20), 4)
    engine.add(first)
    engine.add(second)
    assert engine.stats().backlog_bytes == first.payload_bytes + second.payload_bytes
    engine.step()
    assert engine.stats().backlog_bytes == second.payload_bytes  # "second" still waits for blocks
    assert engine.requests["first"][0].handoff is None and engine.requests["second"][0].handoff is second
    run_engine(engine, [])
    assert_idle(engine, runner)


def test_a_full_backlog_refuses_a_handoff_and_an_empty_one_takes_any():
    size = fake_handoff("x", prompt_of(0, 10), 4).payload_bytes
    engine, runner = make_engine(max_backlog_bytes=size + size // 2)
    engine.add(fake_handoff("a", prompt_of(1, 10), 4))
    with pytest.raises(HandoffRejectedError, match="engine backlog is full"):
        engine.add(fake_handoff("b", prompt_of(2, 10), 4))
    assert engine.stats().backlog_limit_bytes == size + size // 2
    engine.step()
    assert engine.stats().backlog_bytes == 0  # "a" is imported: its bytes left the backlog
    tokens, endings = run_engine(engine, [fake_handoff("huge", prompt_of(3, 40), 4)])  # 4x the limit, alone
    assert endings["huge"].finish_reason is FinishReason.LENGTH
    assert_idle(engine, runner)


# --- swap space --------------------------------------------------------------------------------
def test_without_swap_space_a_more_important_waiter_waits_instead_of_preempting():
    engine, runner = make_engine(num_blocks=8, block_size=4, swap_space_bytes=0)
    background, interactive = list(range(3, 23)), list(range(30, 42))
    engine.add(fake_handoff("background", background, 8, priority=10))  # 6 of 8 blocks
    engine.step()
    engine.add(fake_handoff("interactive", interactive, 4, priority=0))  # needs 4 blocks
    engine.step()
    assert engine.scheduler.running.keys() == {"background"} and engine.stats().num_preemptions == 0
    tokens, endings = run_engine(engine, [])
    assert endings["interactive"].finish_reason is FinishReason.LENGTH
    assert tokens["interactive"] == expected_tokens(interactive, 4)[1:]  # after the prefill worker's first token
    assert_idle(engine, runner)


def test_without_swap_space_a_sequence_that_cannot_grow_fails_the_worst_ranked_one_clearly():
    engine, runner = make_engine(num_blocks=6, block_size=4, swap_space_bytes=0)
    prompts = {"keep": prompt_of(1, 7), "lose": prompt_of(2, 7)}  # 2 blocks each, both grow to 4
    tokens, endings = run_engine(engine, [fake_handoff("keep", prompts["keep"], 8, priority=0),
                                          fake_handoff("lose", prompts["lose"], 8, priority=5)])
    assert endings["lose"].finish_reason is FinishReason.ERROR and "out of KV memory" in endings["lose"].error
    assert tokens["keep"] == expected_tokens(prompts["keep"], 8)
    assert_idle(engine, runner)


def test_swapped_out_blocks_never_exceed_the_swap_space():
    block_bytes = 4 * 64  # block_size x the fake runner's bytes per token
    max_swap_blocks = 5
    rng = random.Random(7)
    engine, runner = make_engine(num_blocks=16, block_size=4, max_num_seqs=6,
                                 swap_space_bytes=max_swap_blocks * block_bytes)
    requests, tokens, endings = {}, {}, {}

    def record(events):
        for event in events:
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finish_reason is not None:
                endings[event.request_id] = event

    for i in range(40):
        rid, prompt, max_tokens = f"r{i}", prompt_of(i, rng.randrange(2, 12)), rng.randrange(2, 14)
        try:
            record(engine.add(fake_handoff(rid, prompt, max_tokens, priority=rng.randrange(-2, 3))))
            requests[rid] = (prompt, max_tokens)
        except HandoffRejectedError:
            pass  # can never fit this pool: refused up front
        record(engine.step() if engine.has_work else [])
        assert sum(len(saved) for saved in runner.swap_space.values()) <= max_swap_blocks
        engine.blocks.check_integrity()
    more_tokens, more_endings = run_engine(engine, [])
    endings.update(more_endings)
    for rid, more in more_tokens.items():
        tokens.setdefault(rid, []).extend(more)
    assert engine.stats().num_preemptions > 0  # swap was used, within its bound
    assert endings.keys() == requests.keys()
    for rid, (prompt, max_tokens) in requests.items():
        if endings[rid].finish_reason is FinishReason.ERROR:
            assert "out of KV memory" in endings[rid].error
        else:
            assert tokens[rid] == expected_tokens(prompt, max_tokens), rid
    assert_idle(engine, runner)


# --- the service, over a real socket -------------------------------------------------------------
async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class Harness:
    """An EngineService on a unix socket, its engine thread running unless told otherwise."""

    def __init__(self, tmp_path, engine: DecodeEngine, start_engine: bool = True, **service_args) -> None:
        self.engine = engine
        self.address = f"unix:{tmp_path}/engine.sock"
        self.start_engine = start_engine
        self.service_args = service_args
        self.writers: list[asyncio.StreamWriter] = []  # ours: kept open until the end (a dropped writer closes)
        self.handlers: set[asyncio.Task] = set()  # the service's connection tasks

    async def __aenter__(self) -> "Harness":
        self.service = EngineService(self.engine, asyncio.get_running_loop(), SECRET, **self.service_args)
        self.thread = threading.Thread(target=self.service.run_engine, name="engine", daemon=True)
        if self.start_engine:
            self.thread.start()
        self.server = await start_server(self._handle, self.address)
        return self

    async def _handle(self, reader, writer) -> None:
        task = asyncio.current_task()
        self.handlers.add(task)
        try:
            await self.service.handle_connection(reader, writer)
        finally:
            self.handlers.discard(task)

    def start(self) -> None:
        self.thread.start()

    async def connect(self, role: str):
        reader, writer = await connect_when_listening(self.address, role, role, SECRET, timeout_s=5)
        self.writers.append(writer)
        return reader, writer

    async def gateway(self):
        reader, writer = await self.connect("gateway")
        await until(lambda: len(self.service.gateways.links) > 0)
        return reader, writer

    async def __aexit__(self, *exc) -> None:
        self.service.stopping.set()
        if self.thread.is_alive():
            await asyncio.to_thread(self.thread.join, 10)
        self.server.close()
        for writer in self.writers:
            writer.close()
        if self.handlers:  # they end on the closed connections; asyncio.run would cancel them noisily
            await asyncio.wait(self.handlers, timeout=10)


async def send_handoff(writer, handoff) -> None:
    await send_message(writer, Handoff(handoff.request_id, encode_handoff(handoff)))


async def read_until_ended(reader, request_ids, timeout_s: float = 20.0) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {}

    async def read():
        while not all(rid in events and events[rid][-1].finish_reason for rid in request_ids):
            message = await read_message(reader)
            assert message is not None, "the engine closed the gateway connection"
            if isinstance(message, Token):
                events.setdefault(message.event.request_id, []).append(message.event)

    await asyncio.wait_for(read(), timeout_s)
    return events


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_the_service_fails_only_the_broken_sequences_and_streams_the_rest(tmp_path):
    engine, runner = make_engine()
    runner.fail_import, runner.poison_logits = {"bad-kv"}, {"bad-logits": math.nan}
    prompts = {rid: prompt_of(i) for i, rid in enumerate(["a", "bad-kv", "b", "bad-logits"])}

    async def scenario():
        async with Harness(tmp_path, engine) as harness:
            gateway, _ = await harness.gateway()
            _, prefill = await harness.connect("prefill")
            for rid, prompt in prompts.items():
                await send_handoff(prefill, fake_handoff(rid, prompt, 8))
            events = await read_until_ended(gateway, prompts)
            await until(lambda: harness.service.snapshot.num_running == 0 and harness.service.snapshot.kv_blocks_used == 0)
            return events, harness.service.snapshot
    events, snapshot = asyncio.run(scenario())
    for rid in ("bad-kv", "bad-logits"):
        assert events[rid][-1].finish_reason is FinishReason.ERROR and events[rid][-1].error
    for rid in ("a", "b"):
        assert events[rid][-1].finish_reason is FinishReason.LENGTH and tokens_of(events[rid]) == expected_tokens(prompts[rid], 8)
    assert snapshot.backlog_bytes == 0 and snapshot.backlog_limit_bytes == engine.backlog.limit_bytes


def test_a_full_backlog_refuses_a_handoff_at_once_and_publishes_its_size(tmp_path):
    first, second = fake_handoff("first", prompt_of(1, 10), 4), fake_handoff("second", prompt_of(2, 10), 4)
    limit = first.payload_bytes + first.payload_bytes // 2
    engine, _ = make_engine(max_backlog_bytes=limit)

    async def scenario():
        async with Harness(tmp_path, engine, start_engine=False) as harness:  # nothing leaves the backlog yet
            gateway, _ = await harness.gateway()
            _, prefill = await harness.connect("prefill")
            await send_handoff(prefill, first)
            await send_handoff(prefill, second)
            refused = await read_until_ended(gateway, ["second"])
            assert "first" not in refused or not refused["first"][-1].finish_reason
            harness.start()
            done = await read_until_ended(gateway, ["first"])
            await until(lambda: harness.service.snapshot.backlog_bytes == 0)
            return refused, refused.get("first", []) + done["first"], harness.service.snapshot
    refused, first_events, snapshot = asyncio.run(scenario())
    ending = refused["second"][-1]
    assert ending.finish_reason is FinishReason.ERROR and "engine backlog is full" in ending.error
    assert ending.error_code == "engine_busy"  # the gateway answers 503 with Retry-After, not 500
    assert first_events[-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(first_events) == expected_tokens(prompt_of(1, 10), 4)
    assert snapshot.backlog_limit_bytes == limit


def test_a_gateway_that_falls_behind_is_dropped_and_its_endings_wait_for_the_next(tmp_path):
    engine, _ = make_engine()
    limit = 64 << 10
    big = "x" * (20 << 10)

    async def scenario():
        async with Harness(tmp_path, engine, max_queue_bytes=limit) as harness:
            service = harness.service
            stalled, _ = await harness.gateway()  # never reads
            link = next(iter(service.gateways.links))

            async def stream_until(condition):
                for _ in range(1000):  # far more than the socket buffers and the queue hold
                    if condition():
                        return
                    service.gateways.send_events([TokenEvent("streaming", (5,), big)])
                    await asyncio.sleep(0)  # let the sender task write what the socket takes
                raise AssertionError("the queue never filled")

            await stream_until(lambda: len(link.queue) > 1)  # the socket is full: the sender waits in drain
            service.gateways.send_events([TokenEvent.ending("done", FinishReason.STOP)])  # queued behind the stream
            await stream_until(lambda: link.num_queued_bytes + len(big) > limit)
            service.gateways.send_events([TokenEvent("last", (6,), big, FinishReason.LENGTH)])  # the one that overflows
            assert link.closed and not service.gateways.links and link.num_queued_bytes <= limit
            got_through = []
            while (message := await read_message(stalled)) is not None:  # what got through, then the end
                got_through.append(message.event.request_id)
            gateway, _ = await harness.gateway()
            return got_through, await read_until_ended(gateway, ["done", "last"])
    got_through, endings = asyncio.run(scenario())
    assert "streaming" in got_through and not {"done", "last"} & set(got_through)
    assert endings["done"][-1].finish_reason is FinishReason.STOP
    assert endings["last"][-1].finish_reason is FinishReason.LENGTH and endings["last"][-1].text == big


def test_requests_live_when_the_last_gateway_leaves_end_with_a_clear_error(tmp_path):
    engine, _ = make_engine(num_blocks=1000)

    async def scenario():
        async with Harness(tmp_path, engine) as harness:
            gateway, gateway_writer = await harness.gateway()
            _, prefill = await harness.connect("prefill")
            await send_handoff(prefill, fake_handoff("long", prompt_of(1), 3000))
            while (await read_message(gateway)).event.request_id != "long":
                pass
            gateway_writer.close()
            await until(lambda: "long" in harness.service.gateways.pending_endings)
            gateway, _ = await harness.gateway()
            events = await read_until_ended(gateway, ["long"])
            await until(lambda: harness.service.snapshot.kv_blocks_used == 0)
            return events
    ending = asyncio.run(scenario())["long"][-1]
    assert ending.finish_reason is FinishReason.ERROR and "the gateway closed its connection" in ending.error


# --- the process: one thread runs torch --------------------------------------------------------
def _serve_args(tmp_path):
    from decode_gpu.service import server
    return server.parse_args(["--model", "unused.gguf", "--listen", f"unix:{tmp_path}/engine.sock"])


def test_the_engine_is_built_and_stepped_on_the_same_thread_and_not_the_loops(tmp_path, monkeypatch):
    """libgomp keeps a team of OpenMP threads per thread that runs parallel ops. Built on the asyncio thread and
    stepped on another, the engine held more team threads than cores, and its CPU step took twice as long."""
    from decode_gpu.service import server
    threads = {}

    def build(args):
        threads["build"] = threading.current_thread()
        return make_engine()[0]

    async def main():
        stop = asyncio.Event()

        def run_engine(service):
            threads["step"] = threading.current_thread()
            service.loop.call_soon_threadsafe(stop.set)
            service.stopping.wait(10)

        monkeypatch.setattr(server.EngineService, "run_engine", run_engine)
        await server.serve(_serve_args(tmp_path), stop)

    monkeypatch.setattr(server, "build_engine", build)
    asyncio.run(main())
    assert threads["build"] is threads["step"] and threads["step"] is not threading.main_thread()


def test_an_engine_thread_that_dies_ends_the_process_with_an_error(tmp_path, monkeypatch):
    from decode_gpu.service import server

    def run_engine(service):
        raise RuntimeError("inbox broke")

    monkeypatch.setattr(server, "build_engine", lambda args: make_engine()[0])
    monkeypatch.setattr(server.EngineService, "run_engine", run_engine)
    with pytest.raises(SystemExit, match="inbox broke"):
        asyncio.run(server.serve(_serve_args(tmp_path), None))


def test_a_configuration_the_engine_refuses_stops_the_process_with_its_message(tmp_path, monkeypatch):
    from decode_gpu.service import server

    def build(args):
        raise SystemExit("--weight-dtype float16 with --dtype bfloat16: set one of the two")

    monkeypatch.setattr(server, "build_engine", build)
    with pytest.raises(SystemExit, match="set one of the two"):
        asyncio.run(server.serve(_serve_args(tmp_path), asyncio.Event()))


async def arrivals_until_ended(reader, request_id: str, timeout_s: float = 20.0) -> list[tuple[float, TokenEvent]]:
    """(arrival time, event) of one request's events, until its terminal one."""
    seen: list[tuple[float, TokenEvent]] = []

    async def read():
        while not seen or seen[-1][1].finish_reason is None:
            message = await read_message(reader)
            assert message is not None, "the engine closed the gateway connection"
            if isinstance(message, Token) and message.event.request_id == request_id:
                seen.append((time.monotonic(), message.event))

    await asyncio.wait_for(read(), timeout_s)
    return seen


async def with_backlog(harness: Harness):
    """A gateway that has told the engine prompts wait for a prefill worker, and a prefill connection."""
    gateway, gateway_writer = await harness.gateway()
    await send_message(gateway_writer, DecodeYield(None, backlog=True))
    await until(lambda: harness.service.gate.backlog)
    _, prefill = await harness.connect("prefill")
    return gateway, gateway_writer, prefill


def test_with_a_prefill_backlog_steps_start_at_most_once_a_pace(tmp_path):
    pace_s, max_tokens = 0.3, 5
    engine, _ = make_engine()
    prompt = prompt_of(1)

    async def scenario():
        async with Harness(tmp_path, engine, pace_s=pace_s) as harness:
            gateway, _, prefill = await with_backlog(harness)
            await send_handoff(prefill, fake_handoff("paced", prompt, max_tokens))
            return await arrivals_until_ended(gateway, "paced")
    seen = asyncio.run(scenario())
    assert [t for _, e in seen for t in e.token_ids] == expected_tokens(prompt, max_tokens)
    # the first token comes with the handoff, the rest from max_tokens - 1 steps, each a pace after the last began
    steps = [at for at, e in seen[1:] if e.token_ids]
    assert steps[-1] - steps[0] >= (len(steps) - 1) * pace_s * 0.8


def test_a_paced_engine_ends_an_abort_at_once_and_stops_pacing_when_the_backlog_clears(tmp_path):
    pace_s = 5.0  # far longer than anything below may take
    engine, _ = make_engine()

    async def scenario():
        async with Harness(tmp_path, engine, pace_s=pace_s) as harness:
            gateway, gateway_writer, prefill = await with_backlog(harness)
            await send_handoff(prefill, fake_handoff("aborted", prompt_of(1), 50))
            await until(lambda: harness.service.snapshot.generated_tokens >= 1)  # one step; the next waits
            asked = time.monotonic()
            await send_message(gateway_writer, Abort("aborted"))
            aborted = await arrivals_until_ended(gateway, "aborted")
            abort_s = aborted[-1][0] - asked
            released = time.monotonic()  # paced, its 5 steps would take 4 paces at least
            await send_message(gateway_writer, DecodeYield(None, backlog=False))
            await send_handoff(prefill, fake_handoff("released", prompt_of(2), 6))
            done = await arrivals_until_ended(gateway, "released")
            return abort_s, aborted[-1][1], done[-1][0] - released, done[-1][1]
    abort_s, abort_end, release_s, release_end = asyncio.run(scenario())
    assert abort_end.finish_reason is FinishReason.ABORT and abort_s < pace_s * 0.8
    assert release_end.finish_reason is FinishReason.LENGTH and release_s < pace_s * 0.8
