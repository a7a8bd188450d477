"""The gateway's engine connection (edge.core.engine_client): an engine that goes silent (frozen, stopped) past the
heartbeat timeout is declared unresponsive, its requests end at once with a 503 code, and the link is made again;
an engine that keeps sending its stats is left alone however long it runs."""

import asyncio

import pytest
from aiohttp.test_utils import make_mocked_request

from contracts.events import EngineStats, FinishReason
from contracts.framing import accept_peer, send_message, start_server
from contracts.handoff import SamplingParams
from contracts.messages import PrefillDone, Recompute, Stats
from edge.api.errors import decode_error
from edge.api.openai_request import ApiError, parse_request
from edge.config import ServeConfig
from edge.core.engine_client import EngineClient
from edge.core.engine_group import EngineGroup
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlight, InFlightRegistry, RequestStatus
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.core.run import Run
from policies.enforcer import PolicyEnforcer
from policies.loader import parse_policy

SECRET = b"0123456789abcdef0123456789abcdef"
TIMEOUT_S = 2.0  # the engine's heartbeat timeout in these tests (stats come every 0.1 s): under the 5 s default, so
# a client ignoring the configured value fails, and long enough that a loaded box's stalls are not taken for silence
STATS = EngineStats(0, 100, 1600, 0, 0, 0, 0, 1.0, 10.0, 0)


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def engine_scenario(tmp_path, stats_for_s: float):
    """An engine that sends stats every 0.1 s for stats_for_s, then nothing (as a SIGSTOPped process)."""
    address = f"unix:{tmp_path / 'engine.sock'}"
    connections = []
    sent = []  # when the first connection's stats went out (the client's clock: one event loop)

    async def handle(reader, writer):
        if await accept_peer(reader, writer, SECRET) is None:
            return
        connections.append(writer)
        loop = asyncio.get_running_loop()
        until_s = loop.time() + (stats_for_s if len(connections) == 1 else 60)
        while loop.time() < until_s:
            await send_message(writer, Stats(STATS))
            if len(connections) == 1:
                sent.append(loop.time())
            await asyncio.sleep(0.1)
        await reader.read()

    async def scenario():
        server = await start_server(handle, address)
        registry = InFlightRegistry()
        request = InFlight("r1", 0, status=RequestStatus.DECODING)
        registry.add(request)
        client = EngineClient(address, registry, SECRET, heartbeat_timeout_s=TIMEOUT_S)
        task = asyncio.create_task(client.run())
        loop = asyncio.get_running_loop()
        await until(lambda: client.state == "ready")
        event = None
        try:
            event = await asyncio.wait_for(request.events.get(), stats_for_s + TIMEOUT_S + 5.0)
        except TimeoutError:
            pass
        silent_s = loop.time() - sent[-1]  # from the engine's last stats to the request's end
        states = client.state
        await until(lambda: len(connections) == 2 and client.state == "ready")  # the link is made again
        task.cancel()
        server.close()
        return event, silent_s, states, client
    return asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_silent_engine_is_unresponsive_and_its_requests_end_with_a_503(tmp_path):
    event, silent_s, state, client = engine_scenario(tmp_path, stats_for_s=0.2)
    assert event is not None and event.finish_reason is FinishReason.ERROR
    assert event.error_code == "engine_unresponsive" and "stopped responding" in event.error
    assert TIMEOUT_S <= silent_s < TIMEOUT_S + 2.5 and state == "unresponsive" and client.unresponsive_count == 1
    error = decode_error(event)
    assert (error.status, error.code, error.headers) == (503, "engine_unresponsive", {"Retry-After": "2"})


def test_an_engine_that_keeps_sending_stats_is_left_alone(tmp_path):
    event, silent_s, _state, client = engine_scenario(tmp_path, stats_for_s=5.0)  # 2.5x the timeout
    assert event is not None and event.error_code == "engine_unresponsive"  # only once it went silent
    # timed from its last stats, not from the test's start: on a loaded machine the link may be ready late
    assert silent_s >= TIMEOUT_S and client.unresponsive_count == 1


# --- a request admitted as the engine freezes (issue 48) -------------------------------------------------------

POLICY = 'version = 1\ndefault_class = "standard"\n[classes.standard]\npriority = 0\n'


def _gateway(registry: InFlightRegistry, engine: EngineClient) -> Gateway:
    pool = PrefillPool({"w0": "unix:/nonexistent"}, registry, queue_limit=8, choose_engine=engine.choose)
    pool.workers["w0"].state = "ready"  # taken as connected: a job it takes is never sent, so it stays in prefill
    return Gateway(ServeConfig(), "m", pool, engine, registry, Metrics("m"),
                   PolicyEnforcer(parse_policy(POLICY, "p.toml")))


def _admit(gateway: Gateway) -> Run:
    return gateway.admit(make_mocked_request("POST", "/v1/completions"),
                         parse_request({"model": "m", "prompt": [7] * 40, "max_tokens": 4}, "completion"))


def test_requests_admitted_as_the_engine_freezes_end_within_the_heartbeat_bound(tmp_path):
    """One in prefill (its worker would hand its KV to the frozen engine) and one queued behind it end with the
    requests that were decoding, not at request_timeout_s; an embeddings request, which needs no engine, goes on."""
    address = f"unix:{tmp_path / 'engine.sock'}"
    frozen = asyncio.Event()

    async def engine(reader, writer):
        if await accept_peer(reader, writer, SECRET) is None:
            return
        while not frozen.is_set():
            await send_message(writer, Stats(STATS))
            await asyncio.sleep(0.1)
        await reader.read()  # stopped: reads nothing, answers nothing

    async def scenario():
        server = await start_server(engine, address)
        registry = InFlightRegistry()
        client = EngineClient(address, registry, SECRET, heartbeat_timeout_s=TIMEOUT_S)
        gateway = _gateway(registry, client)
        task = asyncio.create_task(client.run())
        await until(lambda: client.state == "ready")
        embedding = InFlight("embd-1", 0, needs_engine=False)
        registry.add(embedding)
        frozen.set()  # the engine stops answering right as the requests are admitted
        prefilling, queued = _admit(gateway), _admit(gateway)
        assert (prefilling.inflight.status, queued.inflight.status) == (RequestStatus.PREFILLING,
                                                                        RequestStatus.WAITING)
        loop = asyncio.get_running_loop()
        started = loop.time()
        errors = []
        for run in (prefilling, queued):
            with pytest.raises(ApiError) as failed:
                await asyncio.wait_for(gateway.next_event(run), 10)  # before the fix: request_timeout_s (300 s)
            errors.append((failed.value.status, failed.value.code, loop.time() - started))
        task.cancel()
        server.close()
        return errors, embedding.events.empty()

    errors, embedding_untouched = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [e[:2] for e in errors] == [(503, "engine_unresponsive")] * 2
    # the heartbeat bound from the engine's last stats (sent up to 0.1 s before it froze), plus a loaded machine's slack
    assert all(waited < TIMEOUT_S + 2.0 for *_, waited in errors), errors
    assert embedding_untouched


@pytest.mark.parametrize("state, code", [("unresponsive", "engine_unresponsive"), ("down", "engine_unavailable")])
def test_a_handoff_reported_while_the_engine_cannot_be_heard_ends_at_once(state, code):
    """The worker's PrefillDone comes after the watchdog ended the engine's requests: nothing would end this one."""
    async def scenario():
        registry = InFlightRegistry()
        client = EngineClient("unix:/nowhere", registry, SECRET, heartbeat_timeout_s=TIMEOUT_S)
        client.state = "ready"  # as at its admission
        gateway = _gateway(registry, client)
        run = _admit(gateway)
        if state == "unresponsive":
            client._unresponsive()  # it ends the run; a drained queue stands for one that was not yet taken
        else:
            client._lost()  # a restart: its prefills are the workers' to fail, so it is not ended here
        while not run.inflight.events.empty():
            run.inflight.events.get_nowait()
        rid = run.inflight.request_id
        registry.deliver(rid, PrefillDone(rid, 40, 10.0, 1000, 1.0))
        with pytest.raises(ApiError) as failed:
            await asyncio.wait_for(gateway.next_event(run), 5)
        return failed.value

    error = asyncio.run(scenario())
    assert (error.status, error.code) == (503, code)


def test_a_group_engine_ends_only_the_requests_chosen_for_it():
    registry = InFlightRegistry()
    clients = {name: EngineClient("unix:/nowhere", registry, SECRET, name) for name in ("decode-0", "decode-1")}
    EngineGroup(clients, registry)
    mine, other, waiting = InFlight("mine", 0), InFlight("other", 0), InFlight("waiting", 0)
    mine.engine, other.engine = "decode-0", "decode-1"
    mine.status = other.status = RequestStatus.PREFILLING
    for request in (mine, other, waiting):
        registry.add(request)
    clients["decode-0"]._unresponsive()
    assert mine.events.get_nowait().error_code == "engine_unresponsive"
    assert other.events.empty() and waiting.events.empty()  # another engine may still take the queued one


def test_a_recompute_frame_goes_to_the_callback_given_at_construction(tmp_path):
    address = f"unix:{tmp_path / 'engine.sock'}"
    ask = Recompute("r", 0, (1, 2, 3), SamplingParams(), 5)

    async def engine(reader, writer):
        if await accept_peer(reader, writer, SECRET) is None:
            return
        await send_message(writer, ask)
        await reader.read()

    async def scenario():
        server = await start_server(engine, address)
        heard = asyncio.Queue()
        client = EngineClient(address, InFlightRegistry(), SECRET,
                              on_recompute=lambda message, link: heard.put_nowait((message, link)))
        task = asyncio.create_task(client.run())
        got = await asyncio.wait_for(heard.get(), 10)
        task.cancel()
        server.close()
        return got, client

    (message, link), client = asyncio.run(scenario())
    assert message == ask and link is client
