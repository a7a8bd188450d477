"""The gateway's engine connection (edge.core.engine_client): an engine that goes silent (frozen, stopped) past the
heartbeat timeout is declared unresponsive, its requests end at once with a 503 code, and the link is made again;
an engine that keeps sending its stats is left alone however long it runs."""

import asyncio

from contracts.events import EngineStats, FinishReason
from contracts.framing import accept_peer, send_message, start_server
from contracts.messages import Stats
from edge.api.errors import decode_error
from edge.core.engine_client import EngineClient
from edge.core.lifecycle import InFlight, InFlightRegistry, RequestStatus

SECRET = b"0123456789abcdef0123456789abcdef"
TIMEOUT_S = 0.4  # the engine's heartbeat timeout in these tests (stats come every 0.1 s)
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
            event = await asyncio.wait_for(request.events.get(), stats_for_s + 2.0)
        except TimeoutError:
            pass
        silent_s = loop.time() - sent[-1]  # from the engine's last stats to the request's end
        states = client.state
        await until(lambda: len(connections) == 2 and client.state == "ready")  # the link is made again
        task.cancel()
        server.close()
        return event, silent_s, states, client
    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_silent_engine_is_unresponsive_and_its_requests_end_with_a_503(tmp_path):
    event, silent_s, state, client = engine_scenario(tmp_path, stats_for_s=0.2)
    assert event is not None and event.finish_reason is FinishReason.ERROR
    assert event.error_code == "engine_unresponsive" and "stopped responding" in event.error
    assert TIMEOUT_S <= silent_s < TIMEOUT_S + 1.0 and state == "unresponsive" and client.unresponsive_count == 1
    error = decode_error(event)
    assert (error.status, error.code, error.headers) == (503, "engine_unresponsive", {"Retry-After": "2"})


def test_an_engine_that_keeps_sending_stats_is_left_alone(tmp_path):
    event, silent_s, _state, client = engine_scenario(tmp_path, stats_for_s=1.0)  # 2.5x the timeout
    assert event is not None and event.error_code == "engine_unresponsive"  # only once it went silent
    # timed from its last stats, not from the test's start: on a loaded machine the link may be ready late
    assert silent_s >= TIMEOUT_S and client.unresponsive_count == 1
