"""End to end: an embedding GGUF (a tiny mean-pooled BERT) served on its own, driven by the openai client: its vectors
are the transformers model's, normalized, a batch equal to one by one; /v1/rerank (no rank head) and generation
refuse by name; /tokenize still works. One server for the module (no engine: it starts in seconds)."""

import httpx
import numpy as np
import openai
import pytest

from server_process import ServerProcess
from tiny_embedding_gguf import tiny_bert_gguf, torch_model

pytestmark = pytest.mark.slow
MODEL = "tiny-embedder"
TEXTS = ["the cat sat on the mat", "a kitten was sitting on the rug", "quarterly tax filings are due in april"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve")
    config = f'model = "{tiny_bert_gguf("embed")}"\nmodel_name = "{MODEL}"\nprefill_workers = 1\nthreads_per_worker = 1\n'
    server = ServerProcess(config, workdir).start(timeout_s=120)
    yield server
    server.stop()


def test_vectors_match_transformers_and_other_routes_refuse(server):
    import torch
    oai = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    batch = np.array([d.embedding for d in oai.embeddings.create(model=MODEL, input=TEXTS).data])  # [3, 64]
    alone = np.array([oai.embeddings.create(model=MODEL, input=t).data[0].embedding for t in TEXTS])
    tokens = httpx.post(server.base + "/tokenize", json={"model": MODEL, "prompt": TEXTS[0]}).json()["tokens"]
    assert tokens[0] == 2 and tokens[-1] == 3  # [CLS] ... [SEP], as the worker tokenizes an input
    with torch.no_grad():
        hidden = torch_model("embed")(torch.tensor([tokens])).last_hidden_state[0].mean(0).numpy()
    assert np.abs(batch[0] - hidden / np.linalg.norm(hidden)).max() < 1e-4
    assert batch.shape == (3, 64) and np.abs(batch - alone).max() < 1e-4
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    rerank = httpx.post(server.base + "/v1/rerank", json={"model": MODEL, "query": "cat", "documents": ["a"]})
    assert rerank.status_code == 400 and "no rank head" in rerank.json()["error"]["message"]
    card = oai.models.list().data[0]
    assert card.id == MODEL and card.task == "embedding" and card.dimensions == 64
