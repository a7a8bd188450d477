"""The prefill worker's core: llama.cpp prefills a prompt, samples its first token and exports its KV.

One llama.cpp context serves prompts one after another: each prompt is decoded in n_batch chunks as
sequence 0, its KV exported with llama_state_seq_get_data and parsed, then the sequence is freed.
With a prompt cache (prefix_cache_tokens > 0), the context also keeps recent prompts under other
sequence ids (prefill_cpu.prefix_cache): a prompt that starts like one of them reuses those cells and
prefills only the rest, and a preempted prompt resumes where it stopped.
A context's KV type is fixed; `with_kv_type` builds another context on the same loaded weights.
A cancel is seen between chunks and also inside one: llama.cpp's abort callback asks after every graph
node, so a preempted prompt gives the CPU back within milliseconds, not after a whole chunk.
Each choice's first token is drawn by the decode engine's own sampler (sampling/, through prefill_cpu.first_token) on a
view of llama.cpp's logits: the same controls, grammar mask (llguidance, prefill_cpu.grammar) and seeded noise as
every later token; its logprobs stay those of the model's raw distribution.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaContext

from contracts.handoff import FirstToken, KVHandoff, KVLayout, SamplingParams
from contracts.identity import GGUFIdentity, read_gguf_identity
from contracts.kv_dtypes import kv_dtype
from contracts.model_sizes import cpu_flags, model_sizes, worker_repacks
from prefill_cpu.disk_prefix import open_disk_tier, restore_prefix, seq_state_bytes, set_seq_state
from prefill_cpu.first_token import sample_first
from prefill_cpu.grammar import FirstTokenGrammars
from prefill_cpu.kv_rotation import rotations_from_log
from prefill_cpu.kv_state import (
    KVStateFormatError,
    SeqKVState,
    parse_seq_state,
    serialize_seq_state,
    state_from_handoff,
)
from prefill_cpu.llama_log import captured_llama_log
from prefill_cpu.prefill_rate import PrefillRate
from prefill_cpu.prefill_weights import prefill_weights_path, recorded_rate
from prefill_cpu.prefix_cache import PrefixCache
from prefill_cpu.prompt_logprobs import LOGITS_CHUNK, PromptLogprobCollector

log = logging.getLogger(__name__)
SEQ = 0  # the llama.cpp sequence a prompt occupies while it is prefilled (cached prompts use 1, 2, ...)
MIN_LLAMA_CTX = 256  # the Llama object's own context, unused for prefill


class PrefillError(RuntimeError):
    """llama.cpp could not prefill or export a prompt."""


class PrefillCancelledError(RuntimeError):
    """The request was cancelled while it was being prefilled."""


class PromptTooLongError(ValueError):
    """The prompt does not fit the prefill context."""


@dataclass(frozen=True)
class PrefillConfig:
    model_path: str
    n_ctx: int = 4096  # the longest prompt this worker can prefill
    n_batch: int = 512  # prompt tokens per llama_decode call
    n_threads: int = 0  # 0: all cores
    kv_type: str = "q8_0"  # KV cache storage in llama.cpp and on the wire: f16, q8_0, q4_0
    flash_attn: bool | None = None  # None: on (quantized V requires it; f16 prefill is faster with it)
    prefix_cache_tokens: int = 0  # KV cells kept for earlier prompts, on top of n_ctx; 0: no prompt cache
    prefix_cache_entries: int = 8  # earlier prompts kept at most (one llama.cpp sequence each)
    weights: str = "given"  # what llama.cpp loads: given | f16 | bf16 | q8_0 | auto (prefill_cpu.prefill_weights)
    grammar_compile_timeout_s: float | None = None  # a structured output's compile, at most; None: the default
    kv_disk_bytes: int = 0  # the prompt cache's disk tier (prefill_cpu.kv_disk_tier), at most; 0: none
    kv_disk_dir: str = ""  # its root folder; "": under contracts.cache.cache_root()
    worker_name: str = "prefill-0"  # the disk tier's folder is this worker's own
    prefill_copy_kinds: tuple[str, ...] | None = None  # the copies the memory plan leaves room for (None: auto's rule)


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    priority: int = 0
    cache_salt: str = ""  # only cached prompts of this salt are reused, and this one is kept under it
    prompt_logprobs: int = -1  # >= 0: every prompt token's logprob and this many top alternatives (no prefix reuse)


@dataclass(frozen=True)
class PrefillOutcome:
    handoff: KVHandoff | None  # None: max_tokens 0, nothing to decode
    prefill_s: float  # llama_decode over the prompt, and sampling the first token
    export_s: float  # llama_state_seq_get_data, parsing, building the handoff
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache (not computed)
    prompt_logprobs: PromptLogprobCollector | None = None  # when the request asked


class Prefiller:
    def __init__(self, config: PrefillConfig, model: llama_cpp.Llama | None = None) -> None:
        """model: a Llama already loaded from config.model_path whose weights this Prefiller shares (it builds
        only its own llama.cpp context, and the caller closes the model after this Prefiller)."""
        kv = kv_dtype(config.kv_type)
        # flash attention by default for every KV type: without it llama.cpp attends over every cell of the KV
        # buffer, prompt cache included, and f16 prefill measured slower than q8_0 (docs/handoff.md)
        flash_attn = True if config.flash_attn is None else config.flash_attn
        if kv.quantized and not flash_attn:
            raise ValueError(f"KV type {kv.name} needs flash attention (llama.cpp quantizes V only with it)")
        self.config = config
        self.identity: GGUFIdentity = read_gguf_identity(config.model_path)
        threads = config.n_threads or os.cpu_count() or 1
        cache_entries = config.prefix_cache_entries if config.prefix_cache_tokens > 0 else 0
        if cache_entries and self.identity.swa_layers:
            # a sliding-window cache forgets cells its window has passed, so an earlier prompt's cells cannot
            # stand in for a new prompt's prefix
            log.info("prompt cache off: %s has sliding-window layers", os.path.basename(config.model_path))
            cache_entries = 0
        self._owns_model = model is None
        # the file llama.cpp loads; the identity (what handoffs are checked against) stays model_path's
        self.weights_path = model.model_path if model is not None else prefill_weights_path(
            self.identity, config.weights, threads, config.n_batch, copy_kinds=config.prefill_copy_kinds)
        # the Llama object gives us the model, tokenizer and metadata; its own context stays minimal because
        # the prompt cache needs several sequences in one unified KV buffer, which Llama() cannot ask for
        # llama.cpp's repack of the matrices where it measured faster (contracts.model_sizes.worker_repacks)
        self.repacked = None if model is not None else worker_repacks(model_sizes(self.weights_path).layer_types,
                                                                      cpu_flags())
        with _model_params(use_extra_bufts=bool(self.repacked)):
            self.llm = model if model is not None else llama_cpp.Llama(
                model_path=self.weights_path, n_ctx=MIN_LLAMA_CTX, n_batch=min(config.n_batch, MIN_LLAMA_CTX),
                n_threads=threads, n_threads_batch=threads, type_k=kv.ggml_type, type_v=kv.ggml_type,
                flash_attn=flash_attn, verbose=False)
        self.threads = self._threads_in_use = threads
        # real chunks' tokens a second, held against what prefill_weights = auto recorded for this file
        self.rate = PrefillRate(threads, recorded_rate(self.identity, self.weights_path, threads, config.n_batch))
        # asked before each chunk with the prompt's priority: threads for the chunk (the cores may be shared)
        self.threads_now: Callable[[int], int] | None = None
        self._priority = 0  # of the prompt being prefilled
        params = self._context_params(kv, flash_attn, threads, cache_entries)
        lines: list[str] = []
        with captured_llama_log(lines):
            self._context = LlamaContext(model=self.llm._model, params=params, verbose=False)
        rotations = rotations_from_log("".join(lines), self.identity)
        if rotations is None:
            raise PrefillError("llama.cpp did not log whether it rotates the KV (attn_rot_k/attn_rot_v); "
                               "this llama-cpp-python is not the pinned 0.3.36")
        self.k_rotation, self.v_rotation = rotations
        self.cache = PrefixCache(list(range(1, 1 + cache_entries)), config.prefix_cache_tokens)
        self.disk = open_disk_tier(self, flash_attn)  # None without kv_disk_bytes
        self._eog_ids = _eog_ids(self.llm._model.vocab)  # what min_tokens bans
        self.grammars = FirstTokenGrammars(self.llm._model.vocab, self._eog_ids, config.grammar_compile_timeout_s)
        self._batch = llama_cpp.llama_batch_init(config.n_batch, 0, 1)
        self._should_cancel = _never
        # llama.cpp calls this after every graph node; kept on self so ctypes does not free it
        self._abort_callback = llama_cpp.ggml_abort_callback(lambda _data: bool(self._should_cancel()))
        llama_cpp.llama_set_abort_callback(self.ctx, self._abort_callback, None)
        log.info("prefill worker: %s (weights %s, %s), ctx %d, batch %d, %d threads, KV %s, flash attention %s, "
                 "rotation K %d V %d, prompt cache %d tokens in %d entries", os.path.basename(config.model_path),
                 self.weights_path, {True: "repacked", False: "as mapped", None: "shared"}[self.repacked], config.n_ctx,
                 config.n_batch, threads, kv.name, flash_attn, self.k_rotation, self.v_rotation,
                 config.prefix_cache_tokens if cache_entries else 0, cache_entries)

    def _context_params(self, kv, flash_attn: bool, threads: int, cache_entries: int):
        """The Llama's context params, copied, for a context with room for the prompt cache's sequences."""
        config = self.config
        params = llama_cpp.llama_context_params.from_buffer_copy(self.llm.context_params)
        params.n_ctx = config.n_ctx + (config.prefix_cache_tokens if cache_entries else 0)
        params.n_batch = params.n_ubatch = config.n_batch
        params.n_seq_max = 1 + cache_entries
        params.kv_unified = True
        # set again: a shared model's Llama was built for another KV type (or thread count)
        params.type_k = params.type_v = kv.ggml_type
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.n_threads = params.n_threads_batch = threads
        return params

    def with_kv_type(self, kv_type: str) -> Prefiller:
        """Another context on the same weights (not loaded again) with another KV type, e.g. the q4_0 a
        degradation tier asks for. Close it before this Prefiller, which owns the model."""
        flash_attn = None if kv_dtype(kv_type).quantized else self.config.flash_attn
        # no disk tier of its own: degraded requests are rare, and the disk limit is one per worker
        return Prefiller(replace(self.config, kv_type=kv_type, flash_attn=flash_attn, kv_disk_bytes=0), model=self.llm)

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self._context.close()
        if self.disk is not None:
            self.disk.close()  # writes what is queued
        if self._owns_model:
            self.llm.close()

    @property
    def ctx(self):
        return self._context.ctx

    @property
    def vocab_size(self) -> int:
        return llama_cpp.llama_vocab_n_tokens(self.llm._model.vocab)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

    def detokenize(self, tokens: list[int]) -> str:
        return self.llm.detokenize(tokens).decode("utf-8", errors="replace")

    def prefill(self, request: PrefillRequest, should_cancel=lambda: False) -> PrefillOutcome:
        tokens = list(request.prompt_tokens)
        if not tokens:
            raise PromptTooLongError("the prompt is empty")
        if len(tokens) >= self.config.n_ctx:
            raise PromptTooLongError(f"prompt has {len(tokens)} tokens, this worker's context holds "
                                     f"{self.config.n_ctx - 1}")
        self._check_logit_bias(request.sampling)  # before the prompt is computed, not after
        # likewise: a bad constraint fails first; a grammar compiled for another salt (tenant) is never reused
        grammar = self.grammars.matcher(request.sampling.structured, request.cache_salt)
        memory = llama_cpp.llama_get_memory(self.ctx)
        llama_cpp.llama_memory_seq_rm(memory, SEQ, -1, -1)
        scored = PromptLogprobCollector(tokens, request.prompt_logprobs) if request.prompt_logprobs >= 0 else None
        started = time.perf_counter()  # a prefix restored from the disk tier counts as prefill time
        # every position's logits are needed then, so no cached prefix stands in for computing them
        cached, cached_logits = (0, None) if scored is not None else \
            self._reuse_cached_prefix(memory, tokens, request.cache_salt)
        self._should_cancel = should_cancel
        self._priority = request.priority
        decoding = request.sampling.max_tokens > 0
        try:
            self._decode_prompt(tokens, should_cancel, cached, scored)
            self._should_cancel = _never  # sampling and export are short; finish them
            # those kept with the prompt when every cell came from a cache, else a copy of llama.cpp's
            logits = cached_logits if cached_logits is not None else self._last_logits().copy()  # [vocab] float32
            # one per choice; the logits are read, not changed
            first = sample_first(logits, request.sampling, tokens, self._eog_ids, grammar) \
                if decoding else []
            exported = time.perf_counter()
            raw = seq_state_bytes(self.ctx, SEQ) if decoding else None
            state = self._parse_state(raw) if decoding else None
            self._remember(memory, tokens, request.cache_salt, logits)
            if self.disk is not None and raw is not None:  # written by the tier's thread, after the handoff
                self.disk.offer(tokens, request.cache_salt, raw, logits)
        except PrefillCancelledError:
            done = llama_cpp.llama_memory_seq_pos_max(memory, SEQ) + 1  # the chunks finished before the cancel
            self._remember(memory, tokens[:done], request.cache_salt)  # so the requeued prompt resumes from here
            raise
        finally:
            self._should_cancel = _never
            llama_cpp.llama_memory_seq_rm(memory, SEQ, -1, -1)  # the next prompt starts from an empty sequence
        handoff = self._handoff(request, state, first) if decoding else None
        done = time.perf_counter()
        return PrefillOutcome(handoff, prefill_s=exported - started, export_s=done - exported, cached_tokens=cached,
                              prompt_logprobs=scored)

    def _reuse_cached_prefix(self, memory, tokens: list[int], salt: str) -> tuple[int, np.ndarray | None]:
        """Share the cells of the longest cached prefix into SEQ: (how many prompt tokens that covers, the last
        logits when it covers all). The last prompt token is computed again, its logits give the first token, unless
        this very prompt is cached with its last logits: then every cell is shared and nothing is computed, so a
        repeated prompt gets the KV and logits its first computation gave (llama.cpp rounds a token computed alone
        otherwise than inside a chunk, and the same seed's text would part between a miss and a hit). A longer
        prefix in the disk tier than in RAM is restored from it (prefill_cpu.disk_prefix)."""
        repeat = self.cache.repeat(tokens, salt)
        if repeat is not None:
            self.cache.count(hit=True)
            llama_cpp.llama_memory_seq_cp(memory, repeat.seq_id, SEQ, 0, len(tokens))
            return len(tokens), repeat.last_logits
        seq_id, shared = self.cache.match(tokens, salt)
        shared = max(0, min(shared, len(tokens) - 1)) if seq_id is not None else 0
        if self.disk is not None and (restored := restore_prefix(
                self.ctx, self.disk, tokens, salt, SEQ, shared,
                lambda: _free_sequences(memory, self.cache.clear()))) is not None:
            self.cache.count(hit=False)
            return restored
        self.cache.count(hit=shared > 0)
        if shared > 0:
            llama_cpp.llama_memory_seq_cp(memory, seq_id, SEQ, 0, shared)
        return shared, None

    def keep_returned(self, handoff: KVHandoff) -> int:
        """Keep a finished answer's KV (the decode engine's, ReturnedKV) as a prefix in the prompt cache and its disk
        tier, so the next turn of the conversation prefills only its new tokens. The part of it this worker computed
        itself and still holds (the prompt) keeps its own cells; the engine's cells stand for the rest. Returns the
        tokens kept (0: not kept: no cache, another model, KV type or rotation, too long, no room). On the prefill
        thread, between jobs."""
        ident, lay, tokens = self.identity, handoff.layout, list(handoff.prompt_tokens)
        if not self.cache.enabled and self.disk is None:
            return 0
        theirs = (handoff.model_fingerprint, lay.k_dtype, lay.v_dtype, lay.k_rotation, lay.v_rotation)
        if theirs != (ident.fingerprint, self.config.kv_type, self.config.kv_type, self.k_rotation, self.v_rotation) \
                or lay.swa_layers or not tokens or len(tokens) >= self.config.n_ctx:
            return 0
        try:
            raw = serialize_seq_state(state_from_handoff(handoff, SEQ), ident.n_embd_k, ident.n_embd_v)
        except KVStateFormatError as err:
            log.warning("a returned KV of %s was not kept: %s", handoff.request_id, err)
            return 0
        memory = llama_cpp.llama_get_memory(self.ctx)
        try:
            if not set_seq_state(self.ctx, memoryview(bytearray(raw)), SEQ):
                return 0
            seq_id, shared = self.cache.match(tokens, handoff.cache_salt)
            if seq_id is not None and shared > 0:  # llama.cpp's own cells for the prefix this worker computed
                llama_cpp.llama_memory_seq_rm(memory, SEQ, 0, shared)
                llama_cpp.llama_memory_seq_cp(memory, seq_id, SEQ, 0, shared)
            if self.disk is not None:
                self.disk.offer(tokens, handoff.cache_salt, seq_state_bytes(self.ctx, SEQ) if shared else raw, None)
            self._remember(memory, tokens, handoff.cache_salt)
        finally:
            llama_cpp.llama_memory_seq_rm(memory, SEQ, -1, -1)
        return len(tokens)

    def forget_salt(self, salt: str) -> int:
        """Forget every cached prompt of this salt (an operator deleting a tenant's): its cells, and its disk tier's
        files; returns how many files went. On the prefill thread, as every use of the context."""
        _free_sequences(llama_cpp.llama_get_memory(self.ctx), self.cache.clear(salt))
        return self.disk.delete_salt(salt) if self.disk is not None else 0

    def _remember(self, memory, tokens: list[int], salt: str, last_logits: np.ndarray | None = None) -> None:
        """Keep the prompt's cells (and, for a whole prompt, its last logits) in the prompt cache."""
        seq_id, evicted = self.cache.place(tuple(tokens), salt, last_logits)
        _free_sequences(memory, evicted)
        if seq_id is not None:
            llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
            llama_cpp.llama_memory_seq_cp(memory, SEQ, seq_id, -1, -1)

    def _decode_prompt(self, tokens: list[int], should_cancel, start: int = 0,
                       scored: PromptLogprobCollector | None = None) -> None:
        """scored: every position's logits go to it, in smaller chunks (llama.cpp keeps an output buffer the size
        of the largest chunk's logits)."""
        batch = self._batch
        n_batch = self.config.n_batch if scored is None else min(self.config.n_batch, LOGITS_CHUNK)
        for begin in range(start, len(tokens), n_batch):
            if should_cancel():
                raise PrefillCancelledError(f"cancelled after {begin} of {len(tokens)} prompt tokens")
            self._set_threads()
            chunk = tokens[begin:begin + n_batch]
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = begin + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = SEQ
                # only the last prompt token's logits, unless every prompt token is scored
                batch.logits[i] = scored is not None or begin + i == len(tokens) - 1
            began = time.perf_counter()
            rc = llama_cpp.llama_decode(self.ctx, batch)
            if rc == 1 and self.cache.entries:  # no room for this chunk: the cached prompts make room
                _free_sequences(llama_cpp.llama_get_memory(self.ctx), self.cache.clear())
                rc = llama_cpp.llama_decode(self.ctx, batch)
            if rc == 2:  # the abort callback said stop
                raise PrefillCancelledError(f"cancelled within the chunk at {begin} of {len(tokens)} prompt tokens")
            if rc != 0:
                raise PrefillError(f"llama_decode returned {rc} at prompt token {begin}")
            if scored is None:  # scoring asks for every position's logits: not a plain prefill's cost
                self.rate.observe(len(chunk), time.perf_counter() - began, self._threads_in_use)
            if scored is not None:  # [chunk, vocab] float32, a view of llama.cpp's buffer until the next decode
                scored.add(begin, np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx),
                                                        shape=(len(chunk), self.vocab_size)))

    def _set_threads(self) -> None:
        """Follow threads_now (the decode engine may share these cores) between two llama.cpp chunks."""
        if self.threads_now is None:
            return
        threads = self.threads_now(self._priority)
        if threads != self._threads_in_use:
            llama_cpp.llama_set_n_threads(self.ctx, threads, threads)
            self._threads_in_use = threads

    def _last_logits(self) -> np.ndarray:
        """The last prompt token's logits, as a view of llama.cpp's own buffer. # [vocab] float32"""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(self.vocab_size,))

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """The gateway checks the ids against the vocabulary; a request that reaches a worker of another model
        must fail clearly rather than index past llama.cpp's logits."""
        n_vocab = self.vocab_size
        for token, _bias in params.logit_bias:
            if not 0 <= token < n_vocab:
                raise ValueError(f"logit_bias names token {token}, outside this model's vocabulary of {n_vocab}")

    def _parse_state(self, raw: bytes) -> SeqKVState:
        ident = self.identity
        return parse_seq_state(raw, ident.n_layer, ident.n_embd_k, ident.n_embd_v, ident.swa_layers)

    def _handoff(self, request: PrefillRequest, state: SeqKVState, first: list[FirstToken]) -> KVHandoff:
        ident = self.identity
        layout = KVLayout(
            n_layer=ident.n_layer, num_kv_heads=ident.num_kv_heads, head_dim_k=ident.head_dim_k,
            head_dim_v=ident.head_dim_v, k_dtype=state.k_dtype.name, v_dtype=state.v_dtype.name,
            v_transposed=state.v_transposed, k_rotation=self.k_rotation, v_rotation=self.v_rotation,
            rope_layout=ident.rope_layout, swa_layers=state.swa_layers, swa_start=state.swa_start)
        return KVHandoff(
            request_id=request.request_id, model_fingerprint=ident.fingerprint, layout=layout,
            positions=state.positions, prompt_tokens=tuple(request.prompt_tokens), first_token=first[0].token,
            k_layers=state.k_layers, v_layers=state.v_layers, sampling=request.sampling, priority=request.priority,
            first_logprob=first[0].logprob, first_top_logprobs=first[0].top_logprobs, other_choices=tuple(first[1:]))


@contextmanager
def _model_params(**fields):
    """llama_cpp.Llama builds its model params from llama_model_default_params() and takes no use_extra_bufts: for
    the load, the defaults it reads carry `fields`."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        made = default()
        for name, value in fields.items():
            setattr(made, name, value)
        return made
    llama_cpp.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default


def _free_sequences(memory, seq_ids: list[int]) -> None:
    for seq_id in seq_ids:
        llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)


def _eog_ids(vocab) -> tuple[int, ...]:
    """Every token llama.cpp ends generation at (EOS, EOT, ...: a model may have several), once per context
    rather than per request."""
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    return tuple(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))


def _never() -> bool:
    return False
