"""The prefill worker process: takes jobs from the gateway, prefills on llama.cpp, hands KV to the engine.

    python -m prefill_cpu.worker --config-json '{"model": ..., "listen": ...}'   (what edge serve passes)
    python -m prefill_cpu.worker --model PATH.gguf --listen ADDR [--engine ADDR] [--name w0]   (by hand)

Its settings are one WorkerProcessConfig (contracts.process_config), checked against their knobs (contracts.options);
by hand, each is a flag of the same name.

This module is the process: it loads the model and the contexts for the KV types a degradation tier may ask for
(extra_kv_types), links to its own decode engine (prefill_cpu.engine_link; without one, in a Ray cluster, every job
names its engine), listens for the gateway and stops on a signal. The jobs are the worker's: PrefillWorker
(prefill_cpu.prefill_worker) prefills one prompt at a time and hands its KV to the engine; the gateway connection,
common to both kinds of worker, is prefill_cpu.job_server.

An embedding GGUF (contracts.model_kind: an encoder, or one that declares non-causal attention or a pooling type)
makes an embeddings-only worker (EmbeddingWorker, prefill_cpu.embedding_worker): no prefill context, no engine; it
answers embeddings jobs (and rerank jobs for a model with a rank head) and refuses any other job by name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

import psutil

from contracts.cpu_share import CpuShare, split_threads
from contracts.framing import control_secret, start_server
from contracts.model_kind import model_kind
from contracts.model_sizes import model_sizes
from contracts.process_config import WorkerProcessConfig, parse_config
from contracts.prompt_cache import PROMPT_CACHE_RAM_SHARE, prompt_cache_entries, prompt_cache_tokens
from contracts.startup_clock import since_start
from contracts.tasks import spawn
from prefill_cpu.embedding_worker import EmbeddingWorker
from prefill_cpu.engine_link import EngineLink
from prefill_cpu.prefill_worker import PrefillWorker, prepare_extra_contexts
from prefill_cpu.prefiller import PrefillConfig, Prefiller

log = logging.getLogger("prefill_cpu.worker")
ENGINE_STARTUP_WAIT_S = 600.0  # an engine loads its model before it listens


async def serve(config: WorkerProcessConfig) -> None:
    kind = model_kind(config.model)
    if kind.embedding:
        await serve_embeddings(config, kind.reason)
        return
    cache_tokens = worker_cache_tokens(config)
    prefiller = Prefiller(PrefillConfig(config.model, n_ctx=config.n_ctx, n_batch=config.n_batch,
                                        n_threads=config.threads_per_worker, kv_type=config.kv_type,
                                        prefix_cache_tokens=cache_tokens,
                                        prefix_cache_entries=prompt_cache_entries(cache_tokens),
                                        weights=config.prefill_weights, kv_disk_bytes=config.kv_disk_bytes,
                                        kv_disk_dir=config.kv_disk_dir, worker_name=config.name,
                                        prefill_copy_kinds=config.prefill_copy_kinds))
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
    tiers = spawn(worker.log_cache_tiers(), "the prompt cache's counts", log)
    await asyncio.wait([stopping, link], return_when=asyncio.FIRST_COMPLETED)
    tiers.cancel()
    server.close()
    worker.links.close()
    await worker.close_disk_tier()  # what the disk tier has queued is written
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


def worker_cache_tokens(config: WorkerProcessConfig, host_bytes: int | None = None) -> int:
    """The RAM prompt cache's tokens: prefix_cache_tokens within the RAM share (contracts.prompt_cache), at the
    model's KV bytes a token in this worker's KV type."""
    if config.prefix_cache_tokens <= 0:
        return 0
    per_token = model_sizes(config.model).handoff_kv_bytes(config.kv_type)
    ram = psutil.virtual_memory().total if host_bytes is None else host_bytes
    tokens = prompt_cache_tokens(config.prefix_cache_tokens, ram, per_token)
    if tokens < config.prefix_cache_tokens:
        log.info("prompt cache: %d tokens (%.0f MiB at %s), not prefix_cache_tokens = %d: at most %s of the %.1f GiB "
                 "RAM", tokens, tokens * per_token / 2**20, config.kv_type, config.prefix_cache_tokens,
                 f"1/{round(1 / PROMPT_CACHE_RAM_SHARE)}", ram / 2**30)
    return tokens


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
