"""An embedding GGUF on its own: which GGUFs count as embedding models, and a tiny BERT's embeddings and rank scores
on llama.cpp against the transformers model they were written from."""

import asyncio

import gguf
import numpy as np
import pytest

from contracts.handoff import SamplingParams
from contracts.messages import EmbedDone, PrefillFailed, PrefillJob
from contracts.model_kind import model_kind

TEXTS = ("the cat sat on the mat", "a kitten was sitting on the rug", "quarterly tax filings are due in april")
QUERY, DOCUMENTS = "where is the cat", ("the cat sat on the mat", "taxes are due in april", "a dog ran")


def _metadata_only(path, arch: str, **keys) -> str:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if isinstance(value, bool):
            writer.add_bool(key.replace("__", "."), value)
        else:
            writer.add_uint32(key.replace("__", "."), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_embedding_models_are_told_by_their_metadata(tmp_path):
    bert = model_kind(_metadata_only(tmp_path / "a.gguf", "bert"))
    assert bert.embedding and bert.pooling == "mean" and "encoder" in bert.reason
    assert not model_kind(_metadata_only(tmp_path / "b.gguf", "llama")).embedding
    assert not model_kind(_metadata_only(tmp_path / "c.gguf", "llama", llama__pooling_type=0)).embedding
    non_causal = model_kind(_metadata_only(tmp_path / "d.gguf", "qwen3", qwen3__attention__causal=False))
    assert non_causal.embedding and "causal" in non_causal.reason
    reranker = model_kind(_metadata_only(tmp_path / "e.gguf", "qwen3", qwen3__pooling_type=4))
    assert reranker.embedding and reranker.pooling == "rank"


@pytest.fixture(scope="module")
def models():
    import llama_cpp

    from prefill_cpu.embedder import Embedder
    from tiny_embedding_gguf import tiny_bert_gguf
    loaded = {kind: llama_cpp.Llama(tiny_bert_gguf(kind), embedding=True, n_ctx=128, verbose=False)
              for kind in ("embed", "rank")}
    embedders = {kind: Embedder(llm, 512, 1) for kind, llm in loaded.items()}
    yield embedders
    for embedder in embedders.values():
        embedder.close()
    for llm in loaded.values():
        llm.close()


@pytest.mark.slow
def test_bert_embeddings_are_transformers_mean_pooled_and_a_batch_equals_alone(models):
    import torch

    from tiny_embedding_gguf import POSITIONS, torch_model
    embedder = models["embed"]
    assert embedder.n_ctx == POSITIONS and embedder.pooling_name == "mean" and embedder.n_out == embedder.n_embd
    inputs = [embedder.llm.tokenize(t.encode(), add_bos=True) for t in TEXTS]  # [CLS] ... [SEP]
    batch = embedder.embed(inputs).vectors  # [3, 64]
    alone = np.stack([embedder.embed([tokens]).vectors[0] for tokens in inputs])
    with torch.no_grad():
        hidden = [torch_model("embed")(torch.tensor([t])).last_hidden_state[0].mean(0).numpy() for t in inputs]
    reference = np.stack([h / np.linalg.norm(h) for h in hidden])
    assert np.abs(batch - reference).max() < 1e-4  # measured 6e-6 (f32 weights)
    assert np.abs(batch - alone).max() < 1e-4  # measured 5e-6
    with pytest.raises(ValueError, match="no rank head"):
        embedder.rank(inputs)


@pytest.mark.slow
def test_rank_scores_are_the_classifiers_logits_and_a_batch_equals_alone(models):
    import torch

    from tiny_embedding_gguf import CLS, SEP, torch_model
    embedder = models["rank"]
    pairs = embedder.rank_inputs(QUERY, DOCUMENTS)
    query = embedder.llm.tokenize(QUERY.encode(), add_bos=False, special=False)
    assert pairs[0][:len(query) + 2] == [CLS, *query, SEP]  # llama-server's [BOS] query [SEP] document for BERT
    scores = embedder.rank(pairs).vectors  # [3, 1]
    alone = np.stack([embedder.rank([pair]).vectors[0] for pair in pairs])
    with torch.no_grad():
        logits = np.stack([torch_model("rank")(torch.tensor([p])).logits[0].numpy() for p in pairs])
    assert scores.shape == (3, 1) and np.abs(scores - logits).max() < 1e-3  # measured 2e-5
    assert np.abs(scores - alone).max() < 1e-4  # measured 1.6e-5: the batch changes the kernels' order
    with pytest.raises(ValueError, match="rank head"):
        embedder.embed(pairs)


@pytest.mark.slow
def test_a_rank_job_is_answered_with_one_score_a_pair(models):
    embedder = models["rank"]
    job = PrefillJob("rerank-1", SamplingParams(max_tokens=0), 0, task="rank", embed_texts=(QUERY, *DOCUMENTS))
    done = embedder.answer(job, lambda text: [], embedder.llm.n_vocab(), lambda: False)
    assert isinstance(done, EmbedDone) and done.dim == 1 and len(done.num_tokens) == 3
    expected = embedder.rank(embedder.rank_inputs(QUERY, DOCUMENTS)).vectors[:, 0]
    np.testing.assert_allclose(np.frombuffer(done.vectors, dtype="<f4"), expected, atol=1e-6)
    long = PrefillJob("rerank-2", SamplingParams(max_tokens=0), 0, task="rank", embed_texts=(QUERY, "cat " * 200))
    failed = embedder.answer(long, lambda text: [], embedder.llm.n_vocab(), lambda: False)
    assert isinstance(failed, PrefillFailed) and failed.kind == "prompt_too_long" and failed.limit == embedder.n_ctx


@pytest.mark.slow
def test_the_embeddings_only_worker_refuses_generation_by_name():
    from prefill_cpu.worker import EmbeddingWorker
    from tiny_embedding_gguf import tiny_bert_gguf
    worker = EmbeddingWorker(tiny_bert_gguf("embed"), 512, 1, "w0")
    try:
        status = worker.status()
        assert (status.n_embd, status.pooling, status.vocab_size) == (64, "mean", worker.llm.n_vocab())
        job = PrefillJob("cmpl-1", SamplingParams(max_tokens=4), 0, prompt="hello")
        refused = asyncio.run(worker._answer(job, None))
        assert refused.kind == "bad_prompt" and "is an embedding model" in refused.message
        embedded = worker._embed_now(PrefillJob("embd-1", SamplingParams(max_tokens=0), 0, task="embed",
                                                embed_texts=("the cat",)))
        assert isinstance(embedded, EmbedDone) and embedded.num_tokens == (4,)  # [CLS] the cat [SEP]
    finally:
        worker.embedder.close()
        worker.llm.close()
