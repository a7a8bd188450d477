"""The prefill worker process: takes jobs from the gateway, prefills on llama.cpp, hands KV to the engine.

    python -m prefill_cpu.worker --model PATH.gguf --listen ADDR --engine ADDR [--name w0]

It serves one prompt at a time (one llama.cpp context); the gateway owns the priority queue and sends a
worker its next job when it is idle. A cancel between two prefill chunks stops the job.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import time

import llama_cpp

from contracts.framing import (ProtocolError, accept_peer, connect_when_listening, control_secret, read_message,
                               send_message, start_server)
from contracts.handoff import encode_handoff
from contracts.messages import (HEARTBEAT_INTERVAL_S, CancelPrefill, Handoff, Heartbeat, PrefillDone, PrefillFailed,
                                PrefillJob, WorkerStatus)
from contracts.tasks import spawn
from prefill_cpu.prefiller import (PrefillCancelledError, PrefillConfig, Prefiller, PrefillRequest,
                                   PromptTooLongError)
from prefill_cpu.prompt_renderer import BadPromptError, PromptRenderer

log = logging.getLogger("prefill_cpu.worker")


class PrefillWorker:
    def __init__(self, prefiller: Prefiller, name: str, engine_writer: asyncio.StreamWriter,
                 secret: bytes = b"") -> None:
        self.prefiller = prefiller
        self.prefillers = {prefiller.config.kv_type: prefiller}  # a degradation tier may ask for a cheaper KV type
        self.renderer = PromptRenderer(prefiller)
        self.name = name
        self.engine_writer = engine_writer
        self.secret = secret
        self.cancelled: set[str] = set()
        self.lock = asyncio.Lock()  # one llama.cpp context: one prompt at a time

    async def handle_gateway(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await accept_peer(reader, writer, self.secret) is None:
            log.warning("refused a control connection that failed the handshake")
            return
        cfg = self.prefiller.config
        vocab_size = llama_cpp.llama_vocab_n_tokens(self.prefiller.llm._model.vocab)
        await send_message(writer, WorkerStatus(self.name, self.prefiller.identity.fingerprint, cfg.n_ctx, cfg.kv_type,
                                                vocab_size))
        jobs: dict[str, asyncio.Task] = {}  # request id -> its job, until it has answered
        heartbeat = spawn(self._heartbeat(writer, jobs), "heartbeat to the gateway", log)
        try:
            while (message := await read_message(reader)) is not None:
                if isinstance(message, PrefillJob):
                    task = asyncio.create_task(self.run_job(message, writer))
                    jobs[message.request_id] = task
                    task.add_done_callback(lambda _, rid=message.request_id: self._forget(jobs, rid))
                elif isinstance(message, CancelPrefill) and message.request_id in jobs:
                    self.cancelled.add(message.request_id)  # seen between two llama.cpp chunks
        except ProtocolError as err:
            log.error("dropping the gateway connection after a bad frame: %s", err)
        except asyncio.CancelledError:
            pass  # the worker is shutting down
        heartbeat.cancel()
        log.info("gateway disconnected; cancelling %d jobs", len(jobs))
        for task in list(jobs.values()):
            task.cancel()

    async def _heartbeat(self, writer: asyncio.StreamWriter, jobs: dict) -> None:
        """The gateway declares a worker stuck when these stop (a frozen process, a wedged event loop)."""
        try:
            while not writer.is_closing():
                await send_message(writer, Heartbeat(next(iter(jobs), None)))
                await asyncio.sleep(HEARTBEAT_INTERVAL_S)
        except ConnectionError:
            pass  # the gateway went away; handle_gateway cleans up

    def _forget(self, jobs: dict, request_id: str) -> None:
        jobs.pop(request_id, None)
        self.cancelled.discard(request_id)  # a cancel that came too late to matter

    async def run_job(self, job: PrefillJob, writer: asyncio.StreamWriter) -> None:
        async with self.lock:
            reply = await asyncio.to_thread(self._prefill, job) if job.request_id not in self.cancelled else \
                PrefillFailed(job.request_id, "cancelled", "cancelled before prefill started")
            self.cancelled.discard(job.request_id)
            if isinstance(reply, tuple):
                data, done = reply
                started = time.perf_counter()
                await send_message(self.engine_writer, Handoff(job.request_id, data))
                reply = PrefillDone(**{**done.__dict__, "handoff_ms": done.handoff_ms + (time.perf_counter() - started) * 1e3})
            await send_message(writer, reply)

    def _prefill(self, job: PrefillJob):
        try:
            tokens = self._tokens(job)
            limit = min(job.max_prompt_tokens, self.prefiller.config.n_ctx - 1)
            if len(tokens) > limit:
                return PrefillFailed(job.request_id, "prompt_too_long",
                                     f"the prompt has {len(tokens)} tokens; the limit is {limit}", len(tokens), limit)
            max_tokens = job.sampling.max_tokens
            if job.max_total_tokens and len(tokens) + max_tokens > job.max_total_tokens:
                return PrefillFailed(job.request_id, "context_exceeded",
                                     f"the prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                     f"context of {job.max_total_tokens} tokens; lower max_tokens",
                                     len(tokens), job.max_total_tokens)
            request = PrefillRequest(job.request_id, tuple(tokens), job.sampling, job.priority)
            outcome = self._prefiller_for(job.kv_type).prefill(
                request, should_cancel=lambda: job.request_id in self.cancelled)
            started = time.perf_counter()
            data = encode_handoff(outcome.handoff)
            handoff_ms = (outcome.export_s + time.perf_counter() - started) * 1e3
            return data, PrefillDone(job.request_id, len(tokens), outcome.prefill_s * 1e3, len(data), handoff_ms,
                                     cached_tokens=outcome.cached_tokens)
        except PrefillCancelledError as err:
            return PrefillFailed(job.request_id, "cancelled", str(err))
        except (BadPromptError, PromptTooLongError) as err:
            return PrefillFailed(job.request_id, "bad_prompt", str(err))
        except Exception as err:  # the gateway must hear of every failure, whatever it is
            log.exception("prefill of %s failed", job.request_id)
            return PrefillFailed(job.request_id, "internal", f"prefill failed: {err}")

    def _prefiller_for(self, kv_type: str) -> Prefiller:
        """One llama.cpp context per KV type, created on first use (a context's KV type is fixed)."""
        kv_type = kv_type or self.prefiller.config.kv_type
        if kv_type not in self.prefillers:
            log.info("creating a %s KV context for degraded requests", kv_type)
            self.prefillers[kv_type] = Prefiller(dataclasses.replace(self.prefiller.config, kv_type=kv_type))
        return self.prefillers[kv_type]

    def _tokens(self, job: PrefillJob) -> list[int]:
        if job.prompt_tokens is not None:
            return list(job.prompt_tokens)
        if job.messages is not None:
            return self.renderer.chat_tokens([{"role": m.role, "content": m.content} for m in job.messages])
        return self.renderer.completion_tokens(job.prompt or "")


async def serve(args: argparse.Namespace) -> None:
    prefiller = Prefiller(PrefillConfig(args.model, n_ctx=args.n_ctx, n_batch=args.n_batch,
                                        n_threads=args.threads, kv_type=args.kv_type,
                                        prefix_cache_tokens=args.prefix_cache_tokens))
    # the engine listens once its model is loaded
    secret = control_secret(args.engine)
    control_secret(args.listen)  # a TCP listener refuses to start without a secret
    reader, engine_writer = await connect_when_listening(args.engine, "prefill", args.name, secret, timeout_s=600)
    worker = PrefillWorker(prefiller, args.name, engine_writer, secret)
    server = await start_server(worker.handle_gateway, args.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine_gone = asyncio.create_task(reader.read())  # returns when the engine closes the connection
    log.info("prefill worker %s ready on %s", args.name, args.listen)
    done, _ = await asyncio.wait([asyncio.create_task(stop.wait()), engine_gone], return_when=asyncio.FIRST_COMPLETED)
    server.close()
    if engine_gone in done and not stop.is_set():
        log.error("lost the decode engine connection; exiting so the supervisor restarts this worker")
        sys.exit(1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="llama.cpp prefill worker process")
    parser.add_argument("--model", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--name", default="prefill-0")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--kv-type", default="q8_0", choices=["f16", "q8_0", "q4_0"])
    parser.add_argument("--prefix-cache-tokens", type=int, default=2048,
                        help="KV cells kept for recent prompts, so a shared prefix is not prefilled again (0: off)")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s [{args.name}] %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
