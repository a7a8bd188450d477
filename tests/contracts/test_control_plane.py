"""The control sockets between processes: authenticated handshake, version skew, frame caps, and connection
loops that survive bad frames, silent workers and values that cannot travel."""

import asyncio
import dataclasses
import struct
import threading

import pytest

from contracts import PROTOCOL_VERSION
from contracts.events import FinishReason
from contracts.framing import (
    HANDSHAKE_FRAME_BYTES,
    PeerRefusedError,
    ProtocolError,
    accept_peer,
    connect_when_listening,
    pack,
    read_message,
    send_message,
    start_server,
)
from contracts.handoff import SamplingParams
from contracts.messages import Challenge, ChatMessage, Heartbeat, Hello, PrefillFailed, PrefillJob, WorkerStatus
from edge.core.engine_client import EngineClient
from edge.core.lifecycle import InFlight, InFlightRegistry, RequestStatus
from edge.core.prefill_pool import PrefillPool, UnsendableJobError

SECRET = b"0123456789abcdef0123456789abcdef"


def run(coro, timeout_s: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def until(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class Listener:
    """A control-socket listener that passes the handshake and then runs `script(reader, writer, hello)`."""

    def __init__(self, tmp_path, script, secret: bytes = SECRET) -> None:
        self.address = f"unix:{tmp_path / 'peer.sock'}"
        self.script, self.secret = script, secret
        self.hellos: list[Hello] = []
        self.refusals = 0

    async def __aenter__(self):
        self.server = await start_server(self._handle, self.address)
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _handle(self, reader, writer):
        hello = await accept_peer(reader, writer, self.secret)
        if hello is None:
            self.refusals += 1
            return
        self.hellos.append(hello)
        try:
            await self.script(reader, writer, hello)
        finally:
            writer.close()


async def idle(reader, writer, hello):
    await reader.read()


def test_handshake_admits_the_secret_holder_and_refuses_others(tmp_path):
    async def scenario():
        async with Listener(tmp_path, idle) as peer:
            _, writer = await connect_when_listening(peer.address, "gateway", "gw", SECRET)
            writer.close()
            with pytest.raises(PeerRefusedError, match="authentication failed"):
                await connect_when_listening(peer.address, "gateway", "gw", b"another secret entirely!!")
            return peer.hellos, peer.refusals
    hellos, refusals = run(scenario())
    assert [(h.role, h.name) for h in hellos] == [("gateway", "gw")] and refusals == 1


def test_an_unauthenticated_peer_gets_no_frames_and_no_work_done(tmp_path):
    """Another local user's raw PrefillJob (no handshake) is never read as a job."""
    seen = []

    async def record(reader, writer, hello):
        seen.append(await read_message(reader))

    async def scenario():
        async with Listener(tmp_path, record) as peer:
            reader, writer = await asyncio.open_unix_connection(peer.address[len("unix:"):])
            assert isinstance(await read_message(reader), Challenge)
            await send_message(writer, PrefillJob("stolen", SamplingParams()))
            assert await read_message(reader) is not None  # Refused
            assert await reader.read() == b""  # then closed
            return peer.refusals
    assert run(scenario()) == 1 and seen == []


def test_version_skew_is_refused_naming_both_versions(tmp_path):
    async def scenario():
        async with Listener(tmp_path, idle) as peer:
            reader, writer = await asyncio.open_unix_connection(peer.address[len("unix:"):])
            await read_message(reader)
            await send_message(writer, Hello("gateway", "old", PROTOCOL_VERSION - 1, b"n" * 16, b"p" * 32))
            return await read_message(reader)
    refused = run(scenario())
    assert f"protocol version {PROTOCOL_VERSION - 1}" in refused.reason and str(PROTOCOL_VERSION) in refused.reason


def test_an_oversized_frame_is_refused_before_it_is_buffered(tmp_path):
    async def scenario():
        async with Listener(tmp_path, idle) as peer:
            reader, writer = await asyncio.open_unix_connection(peer.address[len("unix:"):])
            await read_message(reader)
            writer.write(struct.pack(">I", 300 << 20))  # announces 300 MiB
            await writer.drain()
            return await reader.read(), peer.refusals
    assert run(scenario()) == (b"", 1)
    with pytest.raises(ProtocolError, match="exceeds"):
        run(read_frame(struct.pack(">I", HANDSHAKE_FRAME_BYTES + 1), HANDSHAKE_FRAME_BYTES))


async def read_frame(data: bytes, limit: int = 1 << 20):
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    return await read_message(reader, limit)


def test_a_malformed_frame_is_a_protocol_error_not_a_type_error():
    body = pack(Heartbeat())[4:].replace(b"Heartbeat", b"Heartbeaz")
    with pytest.raises(ProtocolError, match="unknown frame"):
        run(read_frame(struct.pack(">I", len(body)) + body))
    wrong_type = pack(WorkerStatus("w", "fp", 4096, "q8_0", 49152))[4:].replace(b"\xa4q8_0", b"\x07")  # str -> int
    with pytest.raises(ProtocolError, match="kv_type"):
        run(read_frame(struct.pack(">I", len(wrong_type)) + wrong_type))


def test_the_engine_connection_survives_a_bad_frame_and_fails_its_requests(tmp_path):
    """A garbage frame drops the connection; the client reconnects and the decoding request ends at once."""
    async def garbage_then_idle(reader, writer, hello):
        if len(peer.hellos) == 1:
            writer.write(struct.pack(">I", 4) + b"\x93abc")  # an array of three ints: no frame
            await writer.drain()
        await reader.read()

    async def scenario():
        global peer
        async with Listener(tmp_path, garbage_then_idle) as listener:
            peer = listener
            registry = InFlightRegistry()
            request = InFlight("r1", 0, status=RequestStatus.DECODING)
            registry.add(request)
            client = EngineClient(peer.address, registry, SECRET)
            task = asyncio.create_task(client.run())
            event = await asyncio.wait_for(request.events.get(), 10)
            await until(lambda: len(peer.hellos) == 2 and client.state == "ready")
            task.cancel()
            return event
    event = run(scenario())
    assert event.finish_reason is FinishReason.ERROR and "went away" in event.error
    assert event.error_code == "engine_unavailable"  # a 503 with Retry-After for the client, not a 500


def _job(request_id: str, content: str = "hi") -> PrefillJob:
    return PrefillJob(request_id, SamplingParams(max_tokens=4), messages=(ChatMessage("user", content),))


def test_an_unsendable_job_is_refused_alone_and_the_queue_keeps_going():
    registry = InFlightRegistry()
    pool = PrefillPool({}, registry, queue_limit=8)
    registry.add(InFlight("bad", 0))
    with pytest.raises(UnsendableJobError, match="cannot be sent"):
        pool.submit(_job("bad", "lone surrogate \ud800"))
    registry.add(InFlight("good", 0))
    pool.submit(_job("good"))
    assert [entry.job.request_id for entry in pool.queue] == ["good"]


@pytest.mark.parametrize("recompute", [False, True], ids=["prefill", "recompute"])
@pytest.mark.parametrize("killed", [True, False])
def test_a_silent_worker_is_declared_stuck_and_its_job_moves_or_fails(tmp_path, killed, recompute):
    """A request's own prefill, or the recompute of its preempted choice (the request is decoding meanwhile):
    either goes to another worker, or fails the request at once, never waiting for its deadline."""
    async def status_then_silence(reader, writer, hello):
        await send_message(writer, WorkerStatus("w0", "fp", 4096, "q8_0", 49152))
        await reader.read()  # reads the job, never answers, never beats

    async def scenario():
        async with Listener(tmp_path, status_then_silence) as peer:
            registry = InFlightRegistry()
            pool = PrefillPool({"w0": peer.address}, registry, queue_limit=8, secret=SECRET,
                               heartbeat_timeout_s=0.3)
            stuck = []
            pool.on_stuck = lambda name: stuck.append(name) or killed
            task = asyncio.create_task(pool.run())
            await until(lambda: pool.num_ready == 1)
            request = InFlight("r1", 0, status=RequestStatus.DECODING if recompute else RequestStatus.WAITING)
            registry.add(request)
            pool.submit(PrefillJob("r1", SamplingParams(max_tokens=4), 0, prompt_tokens=(1, 2, 3),
                                   max_prompt_tokens=3, resume_index=0) if recompute else _job("r1"))
            await until(lambda: stuck)
            failure = request.events.get_nowait() if not request.events.empty() else None
            queued = [entry.job.request_id for entry in pool.queue]
            task.cancel()
            return stuck, failure, queued
    stuck, failure, queued = run(scenario())
    assert stuck == ["w0"]
    if killed:
        assert failure is None and queued == ["r1"]  # another worker (or this one, restarted) takes it
    else:
        assert isinstance(failure, PrefillFailed) and failure.kind == "worker_stuck" and queued == []


def test_heartbeats_keep_a_busy_worker_alive(tmp_path):
    """Beats every 0.1 s for twice the heartbeat timeout: only the beats keep it alive. The timeout is 2 s, so that
    a busy machine that runs this process late (both ends share its event loop) does not pass it between beats."""
    timeout_s = 2.0

    async def beating(reader, writer, hello):
        await send_message(writer, WorkerStatus("w0", "fp", 4096, "q8_0", 49152))
        loop = asyncio.get_running_loop()
        ends = loop.time() + 2 * timeout_s
        while loop.time() < ends:
            await send_message(writer, Heartbeat("r1"))
            await asyncio.sleep(0.1)

    async def scenario():
        async with Listener(tmp_path, beating) as peer:
            pool = PrefillPool({"w0": peer.address}, InFlightRegistry(), queue_limit=8, secret=SECRET,
                               heartbeat_timeout_s=timeout_s)
            stuck = []
            pool.on_stuck = lambda name: stuck.append(name) or True
            task = asyncio.create_task(pool.run())
            await until(lambda: pool.num_ready == 1)
            await until(lambda: pool.workers["w0"].state != "ready")  # ends when the script ends
            task.cancel()
            return stuck
    assert run(scenario()) == []


def test_engine_stats_are_read_only_on_the_engine_thread():
    """The asyncio side publishes a snapshot; it never iterates the engine's dicts itself."""
    from decode_gpu.engine import DecodeEngine
    from decode_gpu.service.server import EngineService
    from fake_runner import FakeRunner
    runner = FakeRunner(num_blocks=16, block_size=4)
    runner.gate = None  # no priority gate in this test
    engine = DecodeEngine(runner)
    readers = []
    real_stats = engine.stats
    engine.stats = lambda: readers.append(threading.current_thread().name) or real_stats()

    async def scenario():
        service = EngineService(engine, asyncio.get_running_loop())
        readers.clear()  # the constructor's first snapshot is taken before the engine thread exists
        published = []  # what publish_stats sent: waited for, not slept for (a busy machine may run it late)
        real_broadcast = service.gateways.broadcast
        service.gateways.broadcast = lambda message: published.append(message) or real_broadcast(message)
        thread = threading.Thread(target=service.run_engine, name="engine", daemon=True)
        thread.start()
        await until(lambda: readers)
        publisher = asyncio.create_task(service.publish_stats())
        await until(lambda: len(published) >= 2)  # two publishing intervals
        publisher.cancel()
        service.stopping.set()
        await asyncio.to_thread(thread.join, 5)
        return dataclasses.asdict(service.snapshot)
    snapshot = run(scenario())
    assert set(readers) == {"engine"} and snapshot["num_running"] == 0


@pytest.mark.parametrize("code,status", [("engine_busy", 503), ("kv_cache_full", 503), ("engine_unavailable", 503),
                                         ("", 500)])
def test_a_full_engine_is_a_503_and_a_broken_request_a_500(code, status):
    from contracts.events import TokenEvent
    from edge.api.errors import decode_error
    error = decode_error(TokenEvent.ending("r1", FinishReason.ERROR, "why", error_code=code))
    assert error.status == status and ("Retry-After" in error.headers) == (status == 503)


def test_a_worker_without_its_engine_gets_no_jobs_until_it_is_back(tmp_path):
    jobs = []
    submitted = asyncio.Event()  # not a sleep alone: on a busy machine the job could come after the look

    async def engine_flaps(reader, writer, hello):
        await send_message(writer, WorkerStatus("w0", "fp", 4096, "q8_0", 49152, engine_connected=False))
        reading = asyncio.ensure_future(read_message(reader))
        await submitted.wait()
        await asyncio.sleep(0.3)  # the job submitted must stay queued
        jobs.append(reading.done())
        await send_message(writer, Heartbeat(engine_connected=True))
        jobs.append(await asyncio.wait_for(reading, 5))
        await reader.read()

    async def scenario():
        async with Listener(tmp_path, engine_flaps) as peer:
            registry = InFlightRegistry()
            pool = PrefillPool({"w0": peer.address}, registry, queue_limit=8, secret=SECRET)
            task = asyncio.create_task(pool.run())
            await until(lambda: pool.num_ready == 1)
            registry.add(InFlight("r1", 0))
            pool.submit(_job("r1"))
            submitted.set()
            await until(lambda: len(jobs) == 2)
            task.cancel()
    run(scenario())
    assert jobs[0] is False and isinstance(jobs[1], PrefillJob) and jobs[1].request_id == "r1"


def test_a_secret_file_every_user_may_read_is_refused_and_a_group_readable_one_warned(tmp_path, caplog):
    """Whoever reads the secret can join the control plane: mode o+r is refused; g+r (how container platforms
    hand secrets to a service's group) is taken with a warning."""
    from edge.launch.local import read_secret_file as _read_secret_file
    path = tmp_path / "secret"
    path.write_text("s" * 32 + "\n")
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="edge.app"):
        assert _read_secret_file(str(path)) == "s" * 32
    assert not caplog.records
    path.chmod(0o644)
    with pytest.raises(ValueError, match="every user of this host may open it \\(mode 644\\).*chmod 600"):
        _read_secret_file(str(path))
    path.chmod(0o640)
    with caplog.at_level("WARNING", logger="edge.app"):
        assert _read_secret_file(str(path)) == "s" * 32
    assert "can be read by its group (mode 640)" in caplog.text
    path.chmod(0o600)
    path.write_text("short")
    with pytest.raises(ValueError, match="shorter than 16"):
        _read_secret_file(str(path))
