"""Embeddings on the embedded model: a second llama.cpp context on the prefill worker's weights."""

import numpy as np
import pytest

from prefill_cpu.embedder import MAX_SEQS, Embedder, EmbedError, gguf_pooling

RELATED = ("The cat sat on the mat.", "A kitten was sitting on the rug.")
UNRELATED = "Quarterly tax filings are due in April."


def test_pooling_is_the_ggufs_or_mean():
    import llama_cpp
    assert gguf_pooling({"general.architecture": "bert", "bert.pooling_type": "2"}) == llama_cpp.LLAMA_POOLING_TYPE_CLS
    assert gguf_pooling({"general.architecture": "llama"}) == llama_cpp.LLAMA_POOLING_TYPE_MEAN
    assert gguf_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": "4"}) == \
        llama_cpp.LLAMA_POOLING_TYPE_RANK


def test_inputs_are_packed_by_count_and_tokens():
    embedder = Embedder.__new__(Embedder)
    embedder.n_ctx = 10
    assert embedder._groups([[1] * 4, [1] * 4, [1] * 4, [1] * 10]) == [[0, 1], [2], [3]]
    embedder.n_ctx = 1000
    assert [len(g) for g in embedder._groups([[1]] * (MAX_SEQS + 1))] == [MAX_SEQS, 1]


@pytest.mark.slow
def test_embeddings_rank_related_text_closer_and_batch_equals_alone(embedded_model_path):
    from prefill_cpu.prefiller import PrefillConfig, Prefiller
    prefiller = Prefiller(PrefillConfig(embedded_model_path, n_ctx=512, n_threads=2))
    embedder = Embedder(prefiller.llm, 64, 2)
    try:
        inputs = [prefiller.tokenize(text, add_special=False) for text in (*RELATED, UNRELATED)]
        batch = embedder.embed(inputs).vectors  # [3, n_embd]
        alone = np.stack([embedder.embed([tokens]).vectors[0] for tokens in inputs])
        with pytest.raises(EmbedError, match="limit for an embedding is 64"):
            embedder.embed([[1] * 65])
    finally:
        embedder.close()
        prefiller.close()
    assert batch.shape == (3, embedder.n_embd) and embedder.pooling_name == "mean"
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert batch[0] @ batch[1] > batch[0] @ batch[2] and batch[0] @ batch[1] > batch[1] @ batch[2]
    assert np.abs(batch - alone).max() < 5e-3  # measured 7.5e-4: other sequences in the batch change the kernels' order
