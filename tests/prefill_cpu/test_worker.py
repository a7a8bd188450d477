"""The prefill worker process's job handling, on a tiny GGUF and real llama.cpp, with a fake decode engine
(an asyncio unix server passing the real handshake) and a fake gateway (the real handshake and frames).

What it pins: a cancelled job keeps the context until its thread is out of llama.cpp; the worker outlives its
engine, fails jobs at once while it is away and reconnects; an engine that dies aborts the prompt in prefill;
the extra KV contexts are built at startup on the same weights.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from contracts.framing import accept_peer, connect_when_listening, read_message, send_message, start_server, unpack
from contracts.handoff import SamplingParams, decode_handoff
from contracts.messages import Handoff, Heartbeat, PrefillDone, PrefillFailed, PrefillJob, WorkerStatus
from contracts.tasks import spawn
from prefill_cpu import prefiller as prefiller_module
from prefill_cpu.engine_link import EngineLink, EngineUnavailableError
from prefill_cpu.prefiller import PrefillCancelledError, PrefillConfig, Prefiller
from prefill_cpu.worker import PrefillWorker, prepare_extra_contexts
from tiny_gguf import N_VOCAB

SECRET = b"test-secret"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
LONG = 2000  # prompt tokens: with n_batch 16, 125 llama_decode calls, long enough to act on mid-prefill
log = logging.getLogger("test_worker")


def tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, N_VOCAB, size=n))


def job(request_id: str, prompt: tuple[int, ...], kv_type: str = "") -> PrefillJob:
    return PrefillJob(request_id, GREEDY, prompt_tokens=prompt, max_prompt_tokens=4096, kv_type=kv_type)


@pytest.fixture
def config(tiny_gguf) -> PrefillConfig:
    return PrefillConfig(str(tiny_gguf("llama")), n_ctx=2048, n_batch=16, n_threads=2, kv_type="q8_0")


@pytest.fixture
def sockets():
    where = Path(tempfile.mkdtemp(prefix="wk", dir="/tmp"))  # short: unix socket paths are limited to 108 bytes
    yield where
    shutil.rmtree(where, ignore_errors=True)


class Tracker:
    """Wraps a Prefiller's prefill: which prompts ran, whether two ever overlapped (they must not: one context),
    when one is inside llama.cpp, and whether the abort callback was told to stop."""

    def __init__(self, prefiller: Prefiller) -> None:
        self.real, self.lock = prefiller.prefill, threading.Lock()
        self.inside: list[str] = []
        self.overlaps: list[str] = []
        self.outcomes: dict[str, str] = {}
        self.in_llama = threading.Event()  # llama.cpp has asked the abort callback: it is inside a chunk
        self.cancel_seen = threading.Event()
        self.hold_exit: threading.Event | None = None  # set: a prefill thread waits for it before returning
        prefiller.prefill = self.prefill

    def prefill(self, request, should_cancel):
        with self.lock:
            if self.inside:  # refuse rather than run two threads on one llama.cpp context
                self.overlaps.append(request.request_id)
                raise RuntimeError(f"{request.request_id} entered while {self.inside} was in prefill")
            self.inside.append(request.request_id)
        try:
            outcome = self.real(request, should_cancel=lambda: self._asked(should_cancel))
            self.outcomes[request.request_id] = "done"
            return outcome
        except PrefillCancelledError:
            self.outcomes[request.request_id] = "cancelled"
            raise
        finally:
            if self.hold_exit is not None:
                self.hold_exit.wait(30)
            with self.lock:
                self.inside.remove(request.request_id)

    def _asked(self, should_cancel) -> bool:
        self.in_llama.set()
        stop = bool(should_cancel())
        if stop:
            self.cancel_seen.set()
        return stop


class StubEngine:
    """Stands for the engine link where only its interface matters."""

    def __init__(self, fail_sends: bool = False) -> None:
        self.connected, self.num_losses, self.fail_sends = True, 0, fail_sends
        self.handoffs: list[Handoff] = []

    async def send(self, message) -> None:
        if self.fail_sends:
            raise EngineUnavailableError("the decode engine connection dropped during the handoff: reset")
        self.handoffs.append(message)


class Inbox:
    """Stands for the gateway's end of the connection in run_job: collects the replies."""

    def __init__(self) -> None:
        self.messages = []

    def write(self, frame: bytes) -> None:
        self.messages.append(unpack(frame[4:]))

    async def drain(self) -> None:
        pass


class FakeEngine:
    def __init__(self, address: str) -> None:
        self.address = address
        self.peers: asyncio.Queue = asyncio.Queue()  # each prefill worker's Hello
        self.handoffs: asyncio.Queue = asyncio.Queue()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> FakeEngine:
        self.server = await start_server(self._handle, self.address)
        return self

    async def stop(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        self.writers.clear()

    async def _handle(self, reader, writer) -> None:
        hello = await accept_peer(reader, writer, SECRET)
        if hello is None:
            return
        self.writers.append(writer)
        self.peers.put_nowait(hello)
        while (message := await read_message(reader)) is not None:
            self.handoffs.put_nowait(message)


class Gateway:
    def __init__(self, reader, writer, status: WorkerStatus) -> None:
        self.reader, self.writer, self.status = reader, writer, status

    @classmethod
    async def connect(cls, address: str) -> Gateway:
        reader, writer = await connect_when_listening(address, "gateway", "test", SECRET, timeout_s=10)
        status = await read_message(reader)
        assert isinstance(status, WorkerStatus)
        return cls(reader, writer, status)

    async def ask(self, message: PrefillJob) -> PrefillDone | PrefillFailed:
        await send_message(self.writer, message)
        reply = await self.reply()
        assert reply.request_id == message.request_id, reply
        return reply

    async def reply(self) -> PrefillDone | PrefillFailed:
        while isinstance(message := await asyncio.wait_for(read_message(self.reader), 60), Heartbeat):
            pass
        assert isinstance(message, (PrefillDone, PrefillFailed)), message
        return message

    async def heartbeat(self, engine_connected: bool) -> None:
        """Awaits the first heartbeat that reports this engine state (they come every second)."""
        while True:
            message = await asyncio.wait_for(read_message(self.reader), 10)
            assert isinstance(message, Heartbeat), message
            if message.engine_connected == engine_connected:
                return


async def serving(prefiller: Prefiller, sockets: Path, retry_s=(0.05, 0.2)):
    """A fake engine, a worker linked to it, and a gateway connected to the worker."""
    engine = await FakeEngine(f"unix:{sockets}/engine.sock").start()
    link = EngineLink(engine.address, "w0", SECRET, retry_s)
    link_task = spawn(link.run(), "the engine link under test", log)
    assert await link.wait_connected(10)
    worker = PrefillWorker(prefiller, "w0", link, SECRET)
    server = await start_server(worker.handle_gateway, f"unix:{sockets}/worker.sock")
    gateway = await Gateway.connect(f"unix:{sockets}/worker.sock")
    return engine, link_task, server, gateway


def test_a_cancelled_job_keeps_the_context_until_its_thread_is_out_of_llama_cpp(config):
    """The gateway went away mid-prefill (handle_gateway cancels the job's task): the abort callback is told,
    the lock stays held until the thread returns, and the next job, queued meanwhile, then runs alone and
    exports exactly what the same prompt exported before."""
    prefiller = Prefiller(config)
    tracker = Tracker(prefiller)

    async def scenario():
        engine, inbox = StubEngine(), Inbox()
        worker = PrefillWorker(prefiller, "w0", engine)
        await worker.run_job(job("before", tokens(40, 1)), inbox)
        tracker.hold_exit = threading.Event()
        try:
            long_job = asyncio.create_task(worker.run_job(job("long", tokens(LONG, 2)), inbox))
            await asyncio.to_thread(tracker.in_llama.wait, 30)
            long_job.cancel()
            after = asyncio.create_task(worker.run_job(job("after", tokens(40, 1)), inbox))
            told = asyncio.ensure_future(asyncio.to_thread(tracker.cancel_seen.wait, 30))
            await asyncio.wait([long_job, told], return_when=asyncio.FIRST_COMPLETED)
            assert not long_job.done(), "the cancelled job let go of the context while its thread was in llama.cpp"
            assert told.result() and worker.lock.locked() and tracker.inside == ["long"]
        finally:
            tracker.hold_exit.set()
        await asyncio.gather(long_job, return_exceptions=True)
        assert long_job.cancelled()
        await after
        return engine.handoffs, inbox.messages

    try:
        handoffs, replies = asyncio.run(scenario())
    finally:
        prefiller.close()
    assert tracker.overlaps == [] and tracker.outcomes == {"before": "done", "long": "cancelled", "after": "done"}
    assert [type(r).__name__ for r in replies] == ["PrefillDone", "PrefillDone"]  # none for the cancelled job
    before, after = (decode_handoff(h.data) for h in handoffs)
    assert (after.k_layers, after.v_layers, after.first_token) == (before.k_layers, before.v_layers, before.first_token)


def test_the_worker_outlives_its_engine_and_reconnects(config, sockets):
    prefiller = Prefiller(config)
    tracker = Tracker(prefiller)

    async def scenario():
        engine, link_task, server, gateway = await serving(prefiller, sockets)
        assert gateway.status.engine_connected
        await engine.peers.get()
        await engine.stop()
        await gateway.heartbeat(engine_connected=False)
        failed = await gateway.ask(job("while-away", tokens(40, 3)))
        assert failed.kind == "engine_unavailable" and "not connected to the decode engine" in failed.message
        assert "while-away" not in tracker.outcomes  # failed at once, not prefilled for nothing
        await engine.start()
        hello = await asyncio.wait_for(engine.peers.get(), 10)
        assert (hello.role, hello.name) == ("prefill", "w0")
        await gateway.heartbeat(engine_connected=True)
        done = await gateway.ask(job("back", tokens(40, 3)))
        assert isinstance(done, PrefillDone)
        assert (await asyncio.wait_for(engine.handoffs.get(), 10)).request_id == "back"
        assert (await Gateway.connect(f"unix:{sockets}/worker.sock")).status.engine_connected
        link_task.cancel()
        server.close()

    try:
        asyncio.run(scenario())
    finally:
        prefiller.close()


def test_a_job_naming_another_engine_hands_off_there_over_one_reused_link(config, sockets):
    """Several engines (a Ray cluster): the gateway names the engine in each job; the worker links to it on first
    use and keeps the link, and a job naming none still goes to the worker's own engine."""
    prefiller = Prefiller(config)

    async def scenario():
        own, link_task, server, gateway = await serving(prefiller, sockets)
        other = await FakeEngine(f"unix:{sockets}/other.sock").start()
        for rid in ("there-1", "there-2"):
            assert isinstance(await gateway.ask(replace(job(rid, tokens(40, 8)), engine=other.address)), PrefillDone)
        assert isinstance(await gateway.ask(job("home", tokens(40, 9))), PrefillDone)
        there = [(await asyncio.wait_for(other.handoffs.get(), 10)).request_id for _ in range(2)]
        home = (await asyncio.wait_for(own.handoffs.get(), 10)).request_id
        gone = await gateway.ask(replace(job("gone", tokens(40, 10)), engine=f"unix:{sockets}/none.sock"))
        link_task.cancel()
        server.close()
        return there, home, other.peers.qsize(), gone

    try:
        there, home, hellos, gone = asyncio.run(scenario())
    finally:
        prefiller.close()
    assert there == ["there-1", "there-2"] and home == "home" and hellos == 1  # one connection for both jobs
    assert gone.kind == "engine_unavailable" and "none.sock" in gone.message


def test_a_worker_without_an_engine_of_its_own_takes_jobs_that_name_one(config):
    prefiller = Prefiller(config)

    async def scenario():
        inbox = Inbox()
        worker = PrefillWorker(prefiller, "w0", None)
        assert worker.links.default_connected  # it tells the gateway it can take jobs
        await worker.run_job(job("unnamed", tokens(40, 11)), inbox)
        return inbox.messages

    try:
        (reply,) = asyncio.run(scenario())
    finally:
        prefiller.close()
    assert reply.kind == "engine_unavailable"


def test_an_engine_that_dies_aborts_the_prompt_in_prefill_at_once(config, sockets):
    """Compared with the same worker's full prefill of a prompt as long, measured first."""
    prefiller = Prefiller(config)
    tracker = Tracker(prefiller)

    async def scenario():
        engine, link_task, server, gateway = await serving(prefiller, sockets)
        started = time.perf_counter()
        assert isinstance(await gateway.ask(job("full", tokens(LONG, 4))), PrefillDone)
        full_s = time.perf_counter() - started
        tracker.in_llama.clear()
        await send_message(gateway.writer, job("cut", tokens(LONG, 5)))
        await asyncio.to_thread(tracker.in_llama.wait, 30)
        started = time.perf_counter()
        await engine.stop()
        reply = await gateway.reply()
        link_task.cancel()
        server.close()
        return full_s, time.perf_counter() - started, reply

    try:
        full_s, cut_s, reply = asyncio.run(scenario())
    finally:
        prefiller.close()
    assert reply.kind == "engine_unavailable" and "went away while this prompt was prefilled" in reply.message
    assert tracker.outcomes["cut"] == "cancelled"
    assert cut_s < full_s / 4, f"answered {cut_s:.3f} s after the engine died; a full prefill takes {full_s:.3f} s"


def test_a_failed_handoff_send_fails_the_job_with_engine_unavailable(config):
    prefiller = Prefiller(config)

    async def scenario():
        inbox = Inbox()
        await PrefillWorker(prefiller, "w0", StubEngine(fail_sends=True)).run_job(job("r", tokens(40, 6)), inbox)
        return inbox.messages

    try:
        (reply,) = asyncio.run(scenario())
    finally:
        prefiller.close()
    assert isinstance(reply, PrefillFailed) and reply.kind == "engine_unavailable"
    assert "during the handoff" in reply.message


def test_a_degraded_kv_type_runs_on_a_context_built_at_startup_on_the_same_weights(config, monkeypatch, caplog):
    """The q4_0 context is built by prepare_extra_contexts without loading the weights again; a q4_0 job
    then builds nothing and exports what a q4_0 worker of its own exports. A type not prepared falls back."""
    loads, builds = [], []
    real_llama, real_init = llama_cpp.Llama, Prefiller.__init__

    def counting_llama(*args, **kwargs):
        loads.append(kwargs.get("model_path"))
        return real_llama(*args, **kwargs)

    def counting_init(self, *args, **kwargs):
        builds.append(args)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(prefiller_module.llama_cpp, "Llama", counting_llama)
    monkeypatch.setattr(Prefiller, "__init__", counting_init)
    main = Prefiller(config)
    extra = prepare_extra_contexts(main, ["q4_0", "q8_0"])  # the worker's own type is not built twice
    assert len(loads) == 1 and len(builds) == 2 and [p.config.kv_type for p in extra] == ["q4_0"]
    loads.clear(), builds.clear()

    async def scenario():
        engine, inbox = StubEngine(), Inbox()
        worker = PrefillWorker(main, "w0", engine, extra_prefillers=extra)
        for request_id, kv_type in (("q4", "q4_0"), ("f16", "f16"), ("default", "")):
            await worker.run_job(job(request_id, tokens(75, 7), kv_type), inbox)
        return [decode_handoff(h.data) for h in engine.handoffs], inbox.messages

    try:
        with caplog.at_level(logging.WARNING, logger="prefill_cpu.prefill_worker"):
            (q4, fallback, default), replies = asyncio.run(scenario())
        assert loads == [] and builds == []
        own = Prefiller(replace(config, kv_type="q4_0"))
        try:
            alone = own.prefill(prefiller_module.PrefillRequest("q4", tokens(75, 7), GREEDY)).handoff
        finally:
            own.close()
    finally:
        for prefiller in (*extra, main):
            prefiller.close()
    assert all(isinstance(r, PrefillDone) for r in replies)
    assert (q4.layout.k_dtype, fallback.layout.k_dtype, default.layout.k_dtype) == ("q4_0", "q8_0", "q8_0")
    assert (q4.k_layers, q4.v_layers, q4.layout) == (alone.k_layers, alone.v_layers, alone.layout)
    assert "asked for KV type f16, which this worker did not prepare" in caplog.text


def test_the_engine_link_refuses_a_send_while_disconnected():
    async def scenario():
        with pytest.raises(EngineUnavailableError, match="not connected"):
            await EngineLink("unix:/nonexistent/engine.sock", "w0", SECRET).send(Handoff("r", b""))

    asyncio.run(scenario())


def test_the_worker_s_own_link_connects_as_soon_as_its_engine_listens(sockets):
    """At start the engine loads its model before it listens: the first try waits for it (looking every
    LOCAL_POLL_S), so the worker is linked, and listens, within a poll of the engine, not a backoff later."""
    async def scenario():
        address = f"unix:{sockets}/engine.sock"
        # a backoff (60 s) far past the bound below: a link that backed off instead of waiting cannot pass on a
        # machine however busy, and one that waited passes with room to spare
        link = EngineLink(address, "w0", SECRET, retry_s=(60.0, 60.0), startup_wait_s=60.0)
        link_task = spawn(link.run(), "the engine link under test", log)
        await asyncio.sleep(0.5)  # the engine loads its model
        assert not link.connected and link.last_error is None  # waiting, not failed and backing off
        engine = await FakeEngine(address).start()
        assert await link.wait_connected(20.0)  # a third of the backoff
        link_task.cancel()
        await engine.stop()

    asyncio.run(scenario())
