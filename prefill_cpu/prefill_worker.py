"""A generation model's worker: a job's prompt prefilled on llama.cpp, its KV handed to the decode engine.

It serves one prompt at a time; the gateway owns the priority queue and sends a worker its next job when it
is idle. A cancel reaches llama.cpp's abort callback, which stops the prompt within a graph node; a job whose
gateway went away waits for its thread to leave llama.cpp before the next job may use the context (JobServer).
While the engine is away (prefill_cpu.engine_link), jobs fail at once with engine_unavailable, and the prompt in
prefill when it dropped is aborted. A job may name another engine (PrefillJob.engine: the gateway chooses per
request among several); the worker links to it on first use and keeps the link. Contexts for the KV types a
degradation tier may ask for (extra_kv_types) are built at startup on the same weights; a job asking for a type
not prepared is prefilled with the worker's own type, with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace

from contracts.framing import send_message
from contracts.grammar import GrammarError
from contracts.handoff import HandoffFormatError, decode_handoff, encode_handoff
from contracts.kv_dtypes import kv_dtype
from contracts.messages import (
    CacheTier,
    Handoff,
    PrefillDone,
    PrefillFailed,
    PrefillJob,
    PromptLogprobs,
    ReturnedKV,
    WorkerStatus,
)
from contracts.tasks import spawn
from prefill_cpu.disk_prefix import describe_tiers
from prefill_cpu.embedder import Embedder
from prefill_cpu.engine_link import EngineLink, EngineLinks, EngineUnavailableError
from prefill_cpu.job_server import JobServer
from prefill_cpu.prefiller import PrefillCancelledError, Prefiller, PrefillRequest, PromptTooLongError
from prefill_cpu.prompt_renderer import BadPromptError, PromptRenderer

log = logging.getLogger(__name__)
TIERS_LOG_INTERVAL_S = 60.0
MAX_RETURNED_WAITING = 4  # returned answers' KV waiting for the prefill thread; more are dropped (counted)


class PrefillWorker(JobServer):
    def __init__(self, prefiller: Prefiller, name: str, engine: EngineLink | None, secret: bytes = b"",
                 extra_prefillers: tuple[Prefiller, ...] = ()) -> None:
        # engine: this worker's own, or None; the Embedder builds its context on the first embeddings job, on the
        # same weights
        super().__init__(name, secret, EngineLinks(engine, name, secret), PromptRenderer(prefiller),
                         Embedder(prefiller.llm, prefiller.config.n_ctx, prefiller.threads), "prefill")
        self.prefiller = prefiller
        # contexts for the other KV types a degradation tier may ask for, built at startup (prepare_extra_contexts)
        self.prefillers = {p.config.kv_type: p for p in (prefiller, *extra_prefillers)}
        self._warned_kv_types: set[str] = set()
        self.num_returned_kept = self.num_returned_dropped = 0
        self._returned_waiting = 0
        if engine is not None:
            engine.on_returned = self.take_returned

    def take_returned(self, message: ReturnedKV) -> None:
        """A finished answer's KV from the engine (on the loop): kept as a prefix between jobs, on the prefill thread;
        dropped when too many wait (the next job must not queue behind them)."""
        if self._returned_waiting >= MAX_RETURNED_WAITING:
            self.num_returned_dropped += 1
            return
        self._returned_waiting += 1
        spawn(self._keep_returned(message), f"keeping the KV of {message.request_id}", log)

    async def _keep_returned(self, message: ReturnedKV) -> None:
        try:
            handoff = decode_handoff(message.data)
            async with self.lock:
                kept = await asyncio.get_running_loop().run_in_executor(
                    self.thread, self.prefiller.keep_returned, handoff)
            if kept:
                self.num_returned_kept += 1
            else:
                self.num_returned_dropped += 1
            log.debug("kept %d tokens of %s's answer as a prefix", kept, message.request_id)
        except HandoffFormatError as err:
            self.num_returned_dropped += 1
            log.error("a returned KV of %s is malformed: %s", message.request_id, err)
        finally:
            self._returned_waiting -= 1

    def status(self) -> WorkerStatus:
        cfg = self.prefiller.config
        loaded = self.prefiller.weights_path
        weights = "the GGUF" if loaded == self.prefiller.identity.path else os.path.basename(loaded)
        return WorkerStatus(self.name, self.prefiller.identity.fingerprint, cfg.n_ctx, cfg.kv_type,
                            self.prefiller.vocab_size, self.links.default_connected, self.embedder.n_embd,
                            self.embedder.pooling_name, f"{cfg.weights}: {weights}")

    @property
    def vocab_size(self) -> int:
        return self.prefiller.vocab_size

    def cache_tiers(self) -> tuple[CacheTier, ...]:
        """The prompt cache's counts per tier (RAM: llama.cpp cells; disk: prefill_cpu.kv_disk_tier; returned: the
        answers' KV the engine sent back), for the heartbeat; plain numbers, read on any thread."""
        ram, ident = self.prefiller.cache, self.prefiller.identity
        kv = kv_dtype(self.prefiller.config.kv_type)
        per_token = ident.n_layer * (kv.row_bytes(ident.n_embd_k) + kv.row_bytes(ident.n_embd_v))
        tiers = [CacheTier("ram", ram.num_hits, ram.num_misses, len(ram.entries), ram.num_tokens * per_token,
                           ram.max_tokens * per_token, ram.num_evictions)]
        if self.prefiller.disk is not None:
            s = self.prefiller.disk.stats()
            tiers.append(CacheTier("disk", s.hits, s.misses, s.entries, s.bytes, s.max_bytes, s.evictions))
        tiers.append(CacheTier("returned", self.num_returned_kept, self.num_returned_dropped))
        return tuple(tiers)

    async def log_cache_tiers(self, every_s: float = TIERS_LOG_INTERVAL_S) -> None:
        """A line of the prompt cache's counts every minute in which they changed."""
        last = None
        while True:
            await asyncio.sleep(every_s)
            if (now := self.cache_tiers()) != last:
                log.info("%s", describe_tiers(self.prefiller))
                last = now

    async def forget_salt(self, salt: str) -> tuple[int, int]:
        """Forget a cache salt's (tenant's) prompts: its cells in the prompt cache and its disk tier's files; (entries,
        files) dropped. Between jobs, on the llama.cpp thread (the context is that thread's)."""
        async with self.lock:
            before = len(self.prefiller.cache.entries)
            files = await asyncio.get_running_loop().run_in_executor(self.thread, self.prefiller.forget_salt, salt)
            return before - len(self.prefiller.cache.entries), files

    async def close_disk_tier(self) -> None:
        """At shutdown: the disk tier writes what it has queued (bounded by its queue's bytes)."""
        if self.prefiller.disk is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.prefiller.disk.close)

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
