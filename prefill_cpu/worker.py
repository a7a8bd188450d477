"""The prefill worker process: takes jobs from the gateway, prefills on llama.cpp, hands KV to the engine.

    python -m prefill_cpu.worker --config-json '{"model": ..., "listen": ...}'   (what edge serve passes)
    python -m prefill_cpu.worker --model PATH.gguf --listen ADDR [--engine ADDR] [--name w0]   (by hand)

Its settings are one WorkerProcessConfig (contracts.process_config), checked against their knobs (contracts.options);
by hand, each is a flag of the same name.

It serves one prompt at a time; the gateway owns the priority queue and sends a worker its next job when it
is idle. A cancel reaches llama.cpp's abort callback, which stops the prompt within a graph node; a job whose
gateway went away waits for its thread to leave llama.cpp before the next job may use the context.
The decode engine link (prefill_cpu.engine_link) reconnects on its own: while the engine is away, jobs fail
at once with engine_unavailable, and the prompt in prefill when it dropped is aborted. A job may name another
engine (PrefillJob.engine: the gateway chooses per request among several); the worker links to it on first use
and keeps the link. Without an engine of its own (a Ray cluster) every job names its engine.
Contexts for the KV types a degradation tier may ask for (extra_kv_types) are built at startup on the same
weights; a job asking for a type not prepared is prefilled with the worker's own type, with a warning.

An embedding GGUF (contracts.model_kind: an encoder, or one that declares non-causal attention or a pooling type)
makes an embeddings-only worker (EmbeddingWorker): no prefill context, no engine; it answers embeddings jobs (and
rerank jobs for a model with a rank head) and refuses any other job by name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import os
import signal
import sys
import time
import types
from dataclasses import replace

import llama_cpp

from contracts.cpu_share import CpuShare, split_threads
from contracts.framing import ProtocolError, accept_peer, control_secret, read_message, send_message, start_server
from contracts.grammar import GrammarError
from contracts.handoff import encode_handoff
from contracts.identity import file_fingerprint
from contracts.messages import (
    HEARTBEAT_INTERVAL_S,
    CancelPrefill,
    EmbedDone,
    Handoff,
    Heartbeat,
    PrefillDone,
    PrefillFailed,
    PrefillJob,
    PromptLogprobs,
    WorkerStatus,
)
from contracts.model_kind import model_kind
from contracts.process_config import WorkerProcessConfig, parse_config
from contracts.startup_clock import since_start
from contracts.tasks import spawn
from prefill_cpu.embedder import Embedder
from prefill_cpu.engine_link import EngineLink, EngineLinks, EngineUnavailableError
from prefill_cpu.prefiller import (
    MIN_LLAMA_CTX,
    PrefillCancelledError,
    PrefillConfig,
    Prefiller,
    PrefillRequest,
    PromptTooLongError,
)
from prefill_cpu.prompt_renderer import BadPromptError, PromptRenderer

log = logging.getLogger("prefill_cpu.worker")
ENGINE_STARTUP_WAIT_S = 600.0  # an engine loads its model before it listens


class PrefillWorker:
    def __init__(self, prefiller: Prefiller, name: str, engine: EngineLink | None, secret: bytes = b"",
                 extra_prefillers: tuple[Prefiller, ...] = ()) -> None:
        self.prefiller = prefiller
        # contexts for the other KV types a degradation tier may ask for, built at startup (prepare_extra_contexts)
        self.prefillers = {p.config.kv_type: p for p in (prefiller, *extra_prefillers)}
        self.renderer = PromptRenderer(prefiller)
        # its llama.cpp context is built on the first embeddings job, on the same weights
        self.embedder = Embedder(prefiller.llm, prefiller.config.n_ctx, prefiller.threads)
        self.name = name
        self.secret = secret
        self.links = EngineLinks(engine, name, secret)  # engine: this worker's own, or None
        self.cancelled: set[str] = set()  # read by the prefill thread: llama.cpp's abort callback asks it
        self.lock = asyncio.Lock()  # one prompt at a time, and a context's thread finishes before the next starts
        # every prompt on the same thread: each thread that runs llama.cpp keeps an OpenMP team of its own, and with
        # more of them than cores libgomp stops spinning between parallel regions (the decode engine's EngineThread)
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self._warned_kv_types: set[str] = set()

    def status(self) -> WorkerStatus:
        cfg = self.prefiller.config
        loaded = self.prefiller.weights_path
        weights = "the GGUF" if loaded == self.prefiller.identity.path else os.path.basename(loaded)
        return WorkerStatus(self.name, self.prefiller.identity.fingerprint, cfg.n_ctx, cfg.kv_type,
                            self.prefiller.vocab_size, self.links.default_connected, self.embedder.n_embd,
                            self.embedder.pooling_name, f"{cfg.weights}: {weights}")

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
                await send_message(writer, Heartbeat(next(iter(jobs), None), self.links.default_connected))
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

    @property
    def vocab_size(self) -> int:
        return self.prefiller.vocab_size

    async def _answer(self, job: PrefillJob, writer: asyncio.StreamWriter) -> PrefillDone | PrefillFailed:
        rid = job.request_id
        if rid in self.cancelled:
            return PrefillFailed(rid, "cancelled", "cancelled before prefill started")
        if job.sampling.max_tokens == 0:  # nothing to decode: no engine takes part
            result = await self._in_thread(job, self._prefiller_for(job.kv_type), lambda: rid in self.cancelled)
            return result if isinstance(result, PrefillFailed) else await self._scored(writer, *result)
        link = await self.links.link_for(job.engine)
        if link is None or not link.connected:  # prefilling would be for nothing: the KV has nowhere to go
            where = f" at {job.engine}" if job.engine else ""
            return PrefillFailed(rid, "engine_unavailable", f"prefill worker {self.name} is not connected to the "
                                 f"decode engine{where} (restarting or down); retry shortly")
        losses = link.num_losses  # a change means the engine dropped: abort, the KV has nowhere to go
        result = await self._in_thread(job, self._prefiller_for(job.kv_type),
                                       lambda: rid in self.cancelled or link.num_losses != losses)
        if link.num_losses != losses and (isinstance(result, tuple) or result.kind == "cancelled"):
            return PrefillFailed(rid, "engine_unavailable", "the decode engine went away while this prompt was "
                                 "prefilled; retry shortly")
        if isinstance(result, PrefillFailed):
            return result
        data, done, scored = result
        await self._scored(writer, data, done, scored)  # before the handoff: the gateway hears it before any token
        return await self._hand_off(link, rid, data, done)

    async def _scored(self, writer: asyncio.StreamWriter, data: bytes | None, done: PrefillDone,
                      scored: PromptLogprobs | None) -> PrefillDone:
        if scored is not None:
            await send_message(writer, scored)
        return done

    async def _in_thread(self, job: PrefillJob, prefiller: Prefiller, should_cancel):
        """The prefill on a thread. If this task is cancelled (the gateway went away), llama.cpp is told to stop
        and the thread is waited for all the same: the lock must not pass to the next job while this thread is
        still inside llama_decode on the same context."""
        future = asyncio.get_running_loop().run_in_executor(self.thread, self._prefill, job, prefiller, should_cancel)
        interrupted = False
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                interrupted = True
                self.cancelled.add(job.request_id)  # the abort callback stops llama_decode within a graph node
        if interrupted:
            future.exception()  # retrieved: _prefill answers every failure, this is never set in practice
            raise asyncio.CancelledError
        return future.result()

    async def _hand_off(self, link: EngineLink, request_id: str, data: bytes,
                        done: PrefillDone) -> PrefillDone | PrefillFailed:
        started = time.perf_counter()
        try:
            await link.send(Handoff(request_id, data))
        except EngineUnavailableError as err:
            return PrefillFailed(request_id, "engine_unavailable", f"{err}; retry shortly")
        return replace(done, handoff_ms=done.handoff_ms + (time.perf_counter() - started) * 1e3)

    def _prefill(self, job: PrefillJob, prefiller: Prefiller, should_cancel):
        """On the prefill thread: (handoff bytes, PrefillDone) or PrefillFailed, never an exception."""
        try:
            tokens = self._tokens(job)
            failed = _check_lengths(job, tokens, prefiller.config.n_ctx)
            if failed is not None:
                return failed
            request = PrefillRequest(job.request_id, tuple(tokens), job.sampling, job.priority, job.cache_salt,
                                     job.prompt_logprobs)
            outcome = prefiller.prefill(request, should_cancel=should_cancel)
            started = time.perf_counter()
            data = None if outcome.handoff is None else \
                encode_handoff(replace(outcome.handoff, resume_index=job.resume_index, cache_salt=job.cache_salt,
                                       deadline=job.deadline, tpot_slo_ms=job.tpot_slo_ms))
            handoff_ms = (outcome.export_s + time.perf_counter() - started) * 1e3
            done = PrefillDone(job.request_id, len(tokens), outcome.prefill_s * 1e3, len(data or b""), handoff_ms,
                               cached_tokens=outcome.cached_tokens, resumed=job.resume_index >= 0,
                               handed_off=data is not None)
            return data, done, self._prompt_logprobs(job, tokens, outcome)
        except PrefillCancelledError as err:
            return PrefillFailed(job.request_id, "cancelled", str(err))
        except (BadPromptError, PromptTooLongError) as err:
            return PrefillFailed(job.request_id, "bad_prompt", str(err))
        except GrammarError as err:  # the gateway compiled it, so rare: a busy pool, or a compile past its limit here
            return PrefillFailed(job.request_id, err.code, str(err))
        except Exception as err:  # the gateway must hear of every failure, whatever it is
            log.exception("prefill of %s failed", job.request_id)
            return PrefillFailed(job.request_id, "internal", f"prefill failed: {err}")

    def _prompt_logprobs(self, job: PrefillJob, tokens: list[int], outcome) -> PromptLogprobs | None:
        if outcome.prompt_logprobs is None:
            return None
        return outcome.prompt_logprobs.frame(job.request_id, self.prefiller.detokenize)

    def _prefiller_for(self, kv_type: str) -> Prefiller:
        """The context for the KV type a job asks for. One not prepared at startup falls back to the worker's own
        KV type (the request is served, only without the memory it was to save) with a warning, once per type:
        building a context here would load under load, exactly when degradation asks for it."""
        chosen = self.prefillers.get(kv_type or self.prefiller.config.kv_type)
        if chosen is None:
            if kv_type not in self._warned_kv_types:
                self._warned_kv_types.add(kv_type)
                log.warning("a job asked for KV type %s, which this worker did not prepare (extra_kv_types %s); "
                            "prefilling such jobs with %s", kv_type, " ".join(self.prefillers),
                            self.prefiller.config.kv_type)
            chosen = self.prefiller
        return chosen

    def _tokens(self, job: PrefillJob) -> list[int]:
        if job.prompt_tokens is not None:
            vocab_size = self.prefiller.vocab_size
            if (bad := next((t for t in job.prompt_tokens if not 0 <= t < vocab_size), None)) is not None:
                # llama_decode would fail (or read out of bounds) on it; the gateway checks too, once it knows
                raise BadPromptError(f"token id {bad} is outside the vocabulary (0 to {vocab_size - 1})")
            return list(job.prompt_tokens)
        if job.messages is not None:
            return self.renderer.chat_tokens([{"role": m.role, "content": m.content, "tool_calls": m.tool_calls,
                                               "tool_call_id": m.tool_call_id} for m in job.messages], job.tools)
        return self.renderer.completion_tokens(job.prompt or "")


class EmbeddingWorker(PrefillWorker):
    """An embedding GGUF's worker: the weights loaded with embeddings on, the Embedder's context, no prefill context
    and no decode engine. A generation job (which the gateway refuses before it queues one) fails by name."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int, name: str, secret: bytes = b"") -> None:
        self.model_path = model_path
        self.fingerprint = file_fingerprint(model_path)
        # the Llama object gives the weights, tokenizer and metadata; the Embedder builds the context it decodes in
        self.llm = llama_cpp.Llama(model_path, embedding=True, n_ctx=MIN_LLAMA_CTX, n_threads=n_threads,
                                   n_threads_batch=n_threads, verbose=False)
        self.renderer = PromptRenderer(types.SimpleNamespace(llm=self.llm))
        self.embedder = Embedder(self.llm, n_ctx, n_threads)
        self.name, self.secret = name, secret
        self.links = EngineLinks(None, name, secret)  # never used: no job here goes to an engine
        self.cancelled: set[str] = set()
        self.lock = asyncio.Lock()
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embed")

    @property
    def vocab_size(self) -> int:
        return self.llm.n_vocab()

    def status(self) -> WorkerStatus:
        # engine_connected: no job of this worker's needs an engine (the gateway dispatches embeddings regardless)
        return WorkerStatus(self.name, self.fingerprint, self.embedder.n_ctx, "", self.vocab_size, False,
                            self.embedder.n_embd, self.embedder.pooling_name, "embeddings only: the GGUF")

    async def _answer(self, job: PrefillJob, writer: asyncio.StreamWriter) -> PrefillFailed:
        return PrefillFailed(job.request_id, "bad_prompt", f"{os.path.basename(self.model_path)} is an embedding "
                             "model: it computes embeddings (or rerank scores), not text")


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


def _check_lengths(job: PrefillJob, tokens: list[int], n_ctx: int) -> PrefillFailed | None:
    limit = min(job.max_prompt_tokens, n_ctx - 1)
    if len(tokens) > limit:
        return PrefillFailed(job.request_id, "prompt_too_long",
                             f"the prompt has {len(tokens)} tokens; the limit is {limit}", len(tokens), limit)
    max_tokens = job.sampling.max_tokens
    if job.max_total_tokens and len(tokens) + max_tokens > job.max_total_tokens:
        return PrefillFailed(job.request_id, "context_exceeded",
                             f"the prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"context of {job.max_total_tokens} tokens; lower max_tokens",
                             len(tokens), job.max_total_tokens)
    return None


def prepare_extra_contexts(prefiller: Prefiller, kv_types: list[str]) -> tuple[Prefiller, ...]:
    """Build the contexts for the other KV types now, on the loaded weights, not inside the first such job."""
    extra = []
    for kv_type in dict.fromkeys(kv_types):
        if kv_type == prefiller.config.kv_type:
            continue
        started = time.perf_counter()
        extra.append(prefiller.with_kv_type(kv_type))
        log.info("built a %s KV context for degraded requests in %.2f s (weights shared)", kv_type,
                 time.perf_counter() - started)
    return tuple(extra)


async def serve(config: WorkerProcessConfig) -> None:
    kind = model_kind(config.model)
    if kind.embedding:
        await serve_embeddings(config, kind.reason)
        return
    prefiller = Prefiller(PrefillConfig(config.model, n_ctx=config.n_ctx, n_batch=config.n_batch,
                                        n_threads=config.threads_per_worker, kv_type=config.kv_type,
                                        prefix_cache_tokens=config.prefix_cache_tokens, weights=config.prefill_weights))
    extra = prepare_extra_contexts(prefiller, extra_kv_types(config))
    if config.cpu_share_file:  # the engine decodes on these cores: half the threads while it does
        share = CpuShare(config.cpu_share_file)
        threads = prefiller.threads
        log.info("prefill uses %d threads, %d while the decode engine decodes prompts at least as important on the "
                 "same cores", threads, split_threads(threads))
        for context in (prefiller, *extra):
            context.threads_now = lambda priority: share.threads_for(priority, threads)
    secret = control_secret(config.engine or None)
    control_secret(config.listen)  # a TCP listener refuses to start without a secret
    engine, link = await _own_engine(config, secret)
    worker = PrefillWorker(prefiller, config.name, engine, secret, extra)
    server = await start_server(worker.handle_gateway, config.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("prefill worker %s ready on %s, %.1f s after the process started", config.name, config.listen,
             since_start())
    stopping = spawn(stop.wait(), "waiting for a stop signal", log)
    await asyncio.wait([stopping, link], return_when=asyncio.FIRST_COMPLETED)
    server.close()
    worker.links.close()
    if not stop.is_set():  # the link never ends on its own; it failed (spawn logged why)
        sys.exit(1)
    link.cancel()


async def serve_embeddings(config: WorkerProcessConfig, reason: str) -> None:
    """An embedding model's worker: embeddings (and rerank) jobs only, no engine (edge serve starts none)."""
    threads = config.threads_per_worker or os.cpu_count() or 1
    secret = control_secret(config.listen)  # a TCP listener refuses to start without one
    worker = EmbeddingWorker(config.model, config.n_ctx, threads, config.name, secret)
    server = await start_server(worker.handle_gateway, config.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("embeddings worker %s ready on %s (%s: %s pooling, %d dimensions, inputs up to %d tokens)", config.name,
             config.listen, reason, worker.embedder.pooling_name, worker.embedder.n_embd, worker.embedder.n_ctx)
    await stop.wait()
    server.close()
    worker.embedder.close()


async def _own_engine(config: WorkerProcessConfig, secret: bytes) -> tuple[EngineLink | None, asyncio.Future]:
    """The link to the worker's own engine, up before the worker listens, and the task holding it (a never-ending
    stand-in without one: then each job names its engine)."""
    if not config.engine:
        return None, asyncio.get_running_loop().create_future()
    engine = EngineLink(config.engine, config.name, secret, startup_wait_s=ENGINE_STARTUP_WAIT_S)
    link = spawn(engine.run(), "the decode engine link", log)
    # listen once the engine is there (it loads its model first), so a new gateway does not see an engine-less
    # worker as ready; a worker whose engine does not come up serves anyway and reports it in its heartbeats
    started = time.monotonic()
    if not await engine.wait_connected(ENGINE_STARTUP_WAIT_S):
        log.error("the decode engine at %s is not up after %.0f s; serving without it", config.engine,
                  ENGINE_STARTUP_WAIT_S)
    else:
        log.info("prefill worker %s: its model loaded, it waited %.1f s for the decode engine to listen", config.name,
                 time.monotonic() - started)
    return engine, link


def extra_kv_types(config: WorkerProcessConfig) -> list[str]:
    if config.extra_kv_types is not None:
        return list(config.extra_kv_types)
    return ["q4_0"] if config.kv_type != "q4_0" else []


def parse_args(argv=None) -> WorkerProcessConfig:
    """The launcher's one JSON argument, or flags typed by hand (`--help` lists them)."""
    return parse_config(WorkerProcessConfig, sys.argv[1:] if argv is None else argv, "llama.cpp prefill worker process")


def main(argv=None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level,
                        format=f"%(asctime)s %(levelname)s [{config.name}] %(name)s: %(message)s")
    log.info("prefill worker %s process: Python, llama.cpp, torch and the worker's code loaded %.1f s after the "
             "process started", config.name, since_start())
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
