"""Embeddings and reranking on the prefill worker: a llama.cpp context with embeddings on, built on first use.

The prefill context never computes embeddings (that would change its output buffers and slow every prompt); this
one is made only when the first embeddings job arrives, with embeddings on and the GGUF's pooling type. A GGUF
that names none (a generative model) is pooled by the mean of its last hidden states. Every vector is
L2-normalized. Several inputs share one llama_decode, one llama.cpp sequence each, as long as they fit.

A reranker (pooling type rank: a classification head on the pooled row) answers jobs of task "rank": each
(query, document) pair is put together as llama-server does (the GGUF's rerank template, else BOS query EOS SEP
document EOS as the vocabulary adds them) and scored by the head; the score is its first output, unnormalized.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaContext

from contracts.messages import EmbedDone, PrefillFailed, PrefillJob
from contracts.model_kind import POOLING_NAMES

log = logging.getLogger(__name__)
MAX_SEQS = 16  # inputs in one llama_decode
MAX_EMBED_CTX = 2048  # tokens one llama_decode takes, and so the longest input
POOLING_KEY = "{arch}.pooling_type"  # the GGUF's metadata key


class EmbedError(ValueError):
    """Inputs this worker cannot embed (too long, empty, a token outside the vocabulary)."""


class EmbedCancelledError(RuntimeError):
    """The job was cancelled (preempted by a more important one, or its client went away)."""


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray  # [n_inputs, n_embd] float32, each row of norm 1
    num_tokens: tuple[int, ...]


def gguf_pooling(metadata: dict) -> int:
    """The pooling type the GGUF declares; mean when it declares none (or none usable, as a generative model)."""
    arch = metadata.get("general.architecture", "")
    value = metadata.get(POOLING_KEY.format(arch=arch))
    try:
        pooling = int(value) if value is not None else llama_cpp.LLAMA_POOLING_TYPE_MEAN
    except ValueError:
        pooling = llama_cpp.LLAMA_POOLING_TYPE_MEAN
    return pooling if pooling in POOLING_NAMES else llama_cpp.LLAMA_POOLING_TYPE_MEAN


class Embedder:
    """llm: the worker's loaded llama_cpp.Llama (weights shared, not loaded again). n_ctx: the longest input (at most
    the model's trained context: an encoder's learned positions end there)."""

    def __init__(self, llm: llama_cpp.Llama, n_ctx: int, n_threads: int) -> None:
        self.llm = llm
        model = llm._model.model
        self.n_ctx = min(n_ctx, MAX_EMBED_CTX, llama_cpp.llama_model_n_ctx_train(model) or MAX_EMBED_CTX)
        self.n_threads = n_threads
        self.pooling = gguf_pooling(llm.metadata)
        self.n_embd = llama_cpp.llama_model_n_embd(model)
        # what one sequence's pooled output holds: a rank head's outputs (its labels), else the embedding
        self.n_out = llama_cpp.llama_model_n_cls_out(model) if self.is_reranker else self.n_embd
        self._context: LlamaContext | None = None
        self._batch = None
        self._should_cancel: Callable[[], bool] = lambda: False
        # llama.cpp calls this after every graph node; kept on self so ctypes does not free it
        self._abort_callback = llama_cpp.ggml_abort_callback(lambda _data: bool(self._should_cancel()))

    @property
    def pooling_name(self) -> str:
        return POOLING_NAMES[self.pooling]

    @property
    def is_reranker(self) -> bool:
        return self.pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK

    def answer(self, job: PrefillJob, tokenize: Callable[[str], list[int]], vocab_size: int,
               should_cancel: Callable[[], bool]) -> EmbedDone | PrefillFailed:
        """A worker's embeddings job answered: the vectors, or why not (never an exception)."""
        rid = job.request_id
        try:
            if job.task == "rank":  # embed_texts: the query, then the documents
                if not job.embed_texts:
                    raise EmbedError("a rerank job needs a query")
                query, documents = job.embed_texts[0], job.embed_texts[1:]
                inputs = self.rank_inputs(query, documents)
            else:
                inputs = [list(t) for t in job.embed_tokens] if job.embed_tokens else \
                    [tokenize(t) for t in job.embed_texts]
            if (bad := next((t for i in inputs for t in i if not 0 <= t < vocab_size), None)) is not None:
                raise EmbedError(f"token id {bad} is outside the vocabulary (0 to {vocab_size - 1})")
            limit = min(job.max_prompt_tokens, self.n_ctx)
            if (longest := max(map(len, inputs), default=0)) > limit:
                what = "a query and document together have" if job.task == "rank" else "an input has"
                return PrefillFailed(rid, "prompt_too_long", f"{what} {longest} tokens; the limit is {limit}",
                                     longest, limit)
            started = time.perf_counter()
            result = self.rank(inputs, should_cancel) if job.task == "rank" else self.embed(inputs, should_cancel)
            return EmbedDone(rid, result.vectors.shape[1], result.vectors.astype("<f4").tobytes(), result.num_tokens,
                             (time.perf_counter() - started) * 1e3)
        except EmbedCancelledError as err:
            return PrefillFailed(rid, "cancelled", str(err))
        except EmbedError as err:
            return PrefillFailed(rid, "bad_prompt", str(err))
        except Exception as err:  # the gateway must hear of every failure, whatever it is
            log.exception("embeddings of %s failed", rid)
            return PrefillFailed(rid, "internal", f"embeddings failed: {err}")

    def embed(self, inputs: list[list[int]], should_cancel: Callable[[], bool] = lambda: False) -> Embeddings:
        """One normalized vector per input (token lists). Raises EmbedError for an input that cannot be embedded."""
        if self.is_reranker:
            raise EmbedError("this model has a rank head (a reranker): use /v1/rerank, not embeddings")
        return self._run(inputs, should_cancel, normalize=True)

    def rank(self, inputs: list[list[int]], should_cancel: Callable[[], bool] = lambda: False) -> Embeddings:
        """A reranker's head on each input (a query and document put together by rank_inputs): [n_inputs, n_out]
        scores, unnormalized (llama-server's relevance_score is the first)."""
        if not self.is_reranker:
            raise EmbedError(f"this model has no rank head (its embeddings are pooled by {self.pooling_name})")
        return self._run(inputs, should_cancel, normalize=False)

    def rank_inputs(self, query: str, documents: tuple[str, ...] | list[str]) -> list[list[int]]:
        """Each (query, document) pair as llama-server puts it together: the GGUF's rerank template with {query} and
        {document} filled in, else [BOS] query [EOS] [SEP] document [EOS], each marker where the vocabulary adds
        it (EOS falls back to SEP); the texts themselves are tokenized without special tokens."""
        llm, vocab = self.llm, self.llm._model.vocab
        template = llama_cpp.llama_model_chat_template(llm._model.model, b"rerank")
        if template:
            text = template.decode("utf-8")
            return [llm.tokenize(text.replace("{query}", query).replace("{document}", doc).encode("utf-8"),
                                 add_bos=False, special=True) for doc in documents]
        eos = llama_cpp.llama_vocab_eos(vocab)
        sep = llama_cpp.llama_vocab_sep(vocab)
        eos = sep if eos == llama_cpp.LLAMA_TOKEN_NULL else eos
        add_bos, add_eos = llama_cpp.llama_vocab_get_add_bos(vocab), llama_cpp.llama_vocab_get_add_eos(vocab)
        add_sep = llama_cpp.llama_vocab_get_add_sep(vocab)
        query_tokens = llm.tokenize(query.encode("utf-8"), add_bos=False, special=False)
        pairs = []
        for doc in documents:
            tokens = [llama_cpp.llama_vocab_bos(vocab)] if add_bos else []
            tokens += query_tokens + ([eos] if add_eos else []) + ([sep] if add_sep else [])
            tokens += llm.tokenize(doc.encode("utf-8"), add_bos=False, special=False) + ([eos] if add_eos else [])
            pairs.append(tokens)
        return pairs

    def _run(self, inputs: list[list[int]], should_cancel: Callable[[], bool], normalize: bool) -> Embeddings:
        for i, tokens in enumerate(inputs):
            if not tokens:
                raise EmbedError(f"input[{i}] is empty")
            if len(tokens) > self.n_ctx:
                raise EmbedError(f"input[{i}] has {len(tokens)} tokens; the limit for an embedding is {self.n_ctx}")
        self._open()
        self._should_cancel = should_cancel
        vectors = np.empty((len(inputs), self.n_out), dtype=np.float32)  # [n_inputs, n_out]
        try:
            for group in self._groups(inputs):
                self._decode(group, inputs, vectors, normalize)
        finally:
            self._should_cancel = lambda: False
        return Embeddings(vectors, tuple(len(t) for t in inputs))

    def _groups(self, inputs: list[list[int]]) -> list[list[int]]:
        """Input indices, in order, packed into batches of at most MAX_SEQS inputs and n_ctx tokens."""
        groups, group, used = [], [], 0
        for i, tokens in enumerate(inputs):
            if group and (len(group) == MAX_SEQS or used + len(tokens) > self.n_ctx):
                groups.append(group)
                group, used = [], 0
            group.append(i)
            used += len(tokens)
        return [*groups, group] if group else groups

    def _decode(self, group: list[int], inputs: list[list[int]], vectors: np.ndarray, normalize: bool) -> None:
        if self._should_cancel():
            raise EmbedCancelledError("cancelled before its embeddings were computed")
        ctx, batch = self._context.ctx, self._batch
        if memory := llama_cpp.llama_get_memory(ctx):  # an encoder keeps none
            llama_cpp.llama_memory_clear(memory, True)  # each input starts at position 0
        n = 0
        for seq, index in enumerate(group):
            for pos, token in enumerate(inputs[index]):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = True  # every token is an output: the pooling reads them all
                n += 1
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc == 2:
            raise EmbedCancelledError("cancelled while its embeddings were computed")
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for an embeddings batch of {n} tokens")
        for seq, index in enumerate(group):
            pooled = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_seq(ctx, seq), shape=(self.n_out,))
            norm = float(np.linalg.norm(pooled)) if normalize else 0.0
            vectors[index] = pooled / norm if norm > 0 else pooled

    def _open(self) -> None:
        """The embeddings context, built on the first embeddings job: a worker that never embeds never pays for
        it (its KV cells and compute buffer: a worker on the embedded model grew by 160 MiB at n_ctx 2048)."""
        if self._context is not None:
            return
        started = time.perf_counter()
        params = llama_cpp.llama_context_params.from_buffer_copy(self.llm.context_params)
        params.embeddings = True
        params.pooling_type = self.pooling
        params.n_ctx = params.n_batch = params.n_ubatch = self.n_ctx  # an input is decoded whole
        params.n_seq_max = MAX_SEQS
        params.kv_unified = True
        params.type_k = params.type_v = llama_cpp.GGML_TYPE_F16
        params.n_threads = params.n_threads_batch = self.n_threads
        self._context = LlamaContext(model=self.llm._model, params=params, verbose=False)
        self._batch = llama_cpp.llama_batch_init(self.n_ctx, 0, MAX_SEQS)
        llama_cpp.llama_set_abort_callback(self._context.ctx, self._abort_callback, None)
        log.info("embeddings context built in %.2f s: %s pooling, %d dimensions, inputs up to %d tokens",
                 time.perf_counter() - started, self.pooling_name, self.n_embd, self.n_ctx)

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._context is not None:
            self._context.close()
            self._context = None
