"""An embedding GGUF's worker (contracts.model_kind: an encoder, or one that declares non-causal attention or a
pooling type): no prefill context, no engine; it answers embeddings jobs (and rerank jobs for a model with a rank
head) and refuses any other job by name."""

from __future__ import annotations

import asyncio
import os
import types

import llama_cpp

from contracts.identity import file_fingerprint
from contracts.messages import PrefillFailed, PrefillJob, WorkerStatus
from prefill_cpu.embedder import Embedder
from prefill_cpu.engine_link import EngineLinks
from prefill_cpu.job_server import JobServer
from prefill_cpu.prefiller import MIN_LLAMA_CTX
from prefill_cpu.prompt_renderer import PromptRenderer


class EmbeddingWorker(JobServer):
    """The weights loaded with embeddings on, the Embedder's context, no prefill context and no decode engine. A
    generation job (which the gateway refuses before it queues one) fails by name."""

    def __init__(self, model_path: str, n_ctx: int, n_threads: int, name: str, secret: bytes = b"") -> None:
        self.model_path = model_path
        self.fingerprint = file_fingerprint(model_path)
        # the Llama object gives the weights, tokenizer and metadata; the Embedder builds the context it decodes in
        self.llm = llama_cpp.Llama(model_path, embedding=True, n_ctx=MIN_LLAMA_CTX, n_threads=n_threads,
                                   n_threads_batch=n_threads, verbose=False)
        renderer = PromptRenderer(types.SimpleNamespace(llm=self.llm))
        links = EngineLinks(None, name, secret)  # never used: no job here goes to an engine
        super().__init__(name, secret, links, renderer, Embedder(self.llm, n_ctx, n_threads), "embed")

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
