"""A worker's side of its gateway connections: the status first, heartbeats, each job as a task, cancels.

Every worker (PrefillWorker, EmbeddingWorker) is one: it answers embeddings (and rerank) jobs here, on its one
llama.cpp thread, and leaves a generation job's answer (`_answer`) to its kind. A job holds the worker's lock from
before its thread starts until the thread has returned, so that one context serves one job at a time; a job whose
gateway went away stops llama.cpp (the cancelled set, read by its abort callback) and waits for its thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging

from contracts.framing import ProtocolError, accept_peer, read_message, send_message
from contracts.messages import (
    HEARTBEAT_INTERVAL_S,
    CancelPrefill,
    EmbedDone,
    ForgetSalt,
    Heartbeat,
    PrefillDone,
    PrefillFailed,
    PrefillJob,
    SaltForgotten,
    WorkerStatus,
)
from contracts.tasks import spawn
from prefill_cpu.embedder import Embedder
from prefill_cpu.engine_link import EngineLinks
from prefill_cpu.prompt_renderer import PromptRenderer

log = logging.getLogger(__name__)


class JobServer:
    """What every worker does with the gateway: `status`, `vocab_size` and `_answer` are its kind's."""

    def __init__(self, name: str, secret: bytes, links: EngineLinks, renderer: PromptRenderer, embedder: Embedder,
                 thread_name: str) -> None:
        self.name = name
        self.secret = secret
        self.links = links
        self.renderer = renderer
        self.embedder = embedder
        self.cancelled: set[str] = set()  # read by the llama.cpp thread: llama.cpp's abort callback asks it
        self.lock = asyncio.Lock()  # one prompt at a time, and a context's thread finishes before the next starts
        # every prompt on the same thread: each thread that runs llama.cpp keeps an OpenMP team of its own, and with
        # more of them than cores libgomp stops spinning between parallel regions (the decode engine's EngineThread)
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread_name)

    def status(self) -> WorkerStatus:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    async def forget_salt(self, salt: str) -> tuple[int, int]:
        """Drop a salt's cached prompts: (entries, files). A worker without a prompt cache holds none."""
        return 0, 0

    async def _forget_salt(self, salt: str, writer: asyncio.StreamWriter) -> None:
        entries, files = await self.forget_salt(salt)
        try:
            await send_message(writer, SaltForgotten(salt, entries, files))
        except (ConnectionError, RuntimeError):
            pass  # the gateway went away; its request ends with the connection

    def cache_tiers(self) -> tuple:
        """Its prompt cache's tiers (contracts.messages.CacheTier) for the heartbeat; none for a worker without."""
        return ()

    async def _answer(self, job: PrefillJob, writer: asyncio.StreamWriter) -> PrefillDone | PrefillFailed:
        raise NotImplementedError

    async def handle_gateway(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await accept_peer(reader, writer, self.secret) is None:
            log.warning("refused a control connection that failed the handshake")
            return
        await send_message(writer, self.status())
        jobs: dict[str, asyncio.Task] = {}  # request id -> its job, until it has answered
        heartbeat = spawn(self._heartbeat(writer, jobs), "heartbeat to the gateway", log)
        try:
            while (message := await read_message(reader)) is not None:
                if isinstance(message, PrefillJob):
                    task = spawn(self.run_job(message, writer), f"prefill job {message.request_id}", log)
                    jobs[message.request_id] = task
                    task.add_done_callback(lambda _, rid=message.request_id: self._forget(jobs, rid))
                elif isinstance(message, ForgetSalt):
                    spawn(self._forget_salt(message.salt, writer), "forgetting a salt's cached prompts", log)
                elif isinstance(message, CancelPrefill) and message.request_id in jobs:
                    self.cancelled.add(message.request_id)  # llama.cpp's abort callback sees it within a graph node
        except ProtocolError as err:
            log.error("dropping the gateway connection after a bad frame: %s", err)
        except asyncio.CancelledError:
            pass  # the worker is shutting down
        heartbeat.cancel()
        log.info("gateway disconnected; cancelling %d jobs", len(jobs))
        for task in list(jobs.values()):
            task.cancel()  # run_job stops llama.cpp and waits for its thread before the next job may start

    async def _heartbeat(self, writer: asyncio.StreamWriter, jobs: dict) -> None:
        """The gateway declares a worker stuck when these stop (a frozen process, a wedged event loop)."""
        try:
            while not writer.is_closing():
                await send_message(writer, Heartbeat(next(iter(jobs), None), self.links.default_connected,
                                                     self.cache_tiers()))
                await asyncio.sleep(HEARTBEAT_INTERVAL_S)
        except ConnectionError:
            pass  # the gateway went away; handle_gateway cleans up

    def _forget(self, jobs: dict, request_id: str) -> None:
        jobs.pop(request_id, None)
        self.cancelled.discard(request_id)  # a cancel that came too late to matter

    async def run_job(self, job: PrefillJob, writer: asyncio.StreamWriter) -> None:
        try:
            async with self.lock:
                reply = await (self._embed(job) if job.task in ("embed", "rank") else self._answer(job, writer))
        finally:
            self.cancelled.discard(job.request_id)
            _release_freed_memory()
        try:
            await send_message(writer, reply)
        except (ConnectionError, RuntimeError) as err:
            log.warning("could not answer %s: the gateway went away (%s)", job.request_id, err)

    async def _embed(self, job: PrefillJob) -> EmbedDone | PrefillFailed:
        """An embeddings job: no engine takes part; the answer carries the vectors."""
        rid = job.request_id
        if rid in self.cancelled:
            return PrefillFailed(rid, "cancelled", "cancelled before its embeddings were computed")
        future = asyncio.get_running_loop().run_in_executor(self.thread, self._embed_now, job)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the gateway went away: stop llama.cpp, and wait for the thread
            self.cancelled.add(rid)
            await asyncio.wait([future])
            raise

    def _embed_now(self, job: PrefillJob) -> EmbedDone | PrefillFailed:
        return self.embedder.answer(job, self.renderer.completion_tokens, self.vocab_size,
                                    lambda: job.request_id in self.cancelled)


def _release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS after each prompt: a handoff is ~10 MB of transient buffers,
    and without this the worker's RSS holds whatever the largest recent prompts left behind."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: nothing to trim
        return None


_LIBC = _load_libc()
