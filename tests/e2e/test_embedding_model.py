"""End to end: a reranker GGUF (a tiny BERT with a rank head) served on its own: prefill workers and no decode
engine; /v1/rerank scores as llama.cpp itself does, sorted; /v1/embeddings and every generation route refuse it by
name; /v1/models and /health say what it is; keys, filters, rate limits, the audit log and /metrics as on every
route. One server for the module (it starts in seconds: no engine, a 0.3 MiB model)."""

import json

import httpx
import numpy as np
import pytest

from server_process import ServerProcess, wait_for
from tiny_embedding_gguf import CLS, SEP, tiny_bert_gguf, torch_model

pytestmark = pytest.mark.slow
KEY, LIMITED_KEY = "api-key", "limited-key"
POLICY = f"""
version = 1
default_class = "standard"
[filters]
blocked_words = ["forbidden"]
[classes.standard]
priority = 0
[[keys]]
key = "{KEY}"
class = "standard"
[[keys]]
key = "{LIMITED_KEY}"
class = "standard"
requests_per_minute = 1
"""
MODEL = "reranker"
QUERY = "where is the cat"
DOCUMENTS = ["the cat sat on the mat", "taxes are due in april", "a dog ran in the garden", "the cat is home"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve")
    config = (f'model = "{tiny_bert_gguf("rank")}"\nmodel_name = "{MODEL}"\nprefill_workers = 1\n'
              f'threads_per_worker = 1\naudit_log = "{workdir / "audit.jsonl"}"\n')
    server = ServerProcess(config, workdir, POLICY).start(timeout_s=120)
    server.audit = workdir / "audit.jsonl"
    yield server
    server.stop()


def post(server, path, body, key=KEY, headers=None):
    sent = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base + path, json=body, headers={**sent, **(headers or {})}, timeout=60)


def llama_cpp_scores(path: str, pairs: list[list[int]]) -> np.ndarray:
    """llama.cpp's own rank head on each pair, one decode each, straight through its C API."""
    import llama_cpp
    llm = llama_cpp.Llama(path, embedding=True, n_ctx=128, n_batch=128, n_ubatch=128,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, verbose=False)
    scores = []
    for tokens in pairs:
        ids = (llama_cpp.llama_token * len(tokens))(*tokens)  # held: the batch points into it
        batch = llama_cpp.llama_batch_get_one(ids, len(tokens))
        assert llama_cpp.llama_decode(llm._ctx.ctx, batch) == 0
        scores.append(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)[0])
    llm.close()
    return np.array(scores)


def pairs_of(path: str) -> list[list[int]]:
    """llama-server's rerank input for a BERT vocabulary: [CLS] query [SEP] document (it adds BOS and SEP)."""
    import llama_cpp
    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    words = [llm.tokenize(text.encode(), add_bos=False, special=False) for text in (QUERY, *DOCUMENTS)]
    return [[CLS, *words[0], SEP, *doc] for doc in words[1:]]


def test_rerank_scores_are_llama_cpps_sorted_and_cut(server):
    answer = post(server, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    pairs = pairs_of(tiny_bert_gguf("rank"))
    expected = llama_cpp_scores(tiny_bert_gguf("rank"), pairs)
    got = np.empty(len(DOCUMENTS))
    for result in body["results"]:
        got[result["index"]] = result["relevance_score"]
    np.testing.assert_allclose(got, expected, atol=1e-4)  # measured 2e-5: a batch of four against one by one
    import torch
    with torch.no_grad():  # and the transformers model the GGUF was written from: its logits
        reference = np.array([torch_model("rank")(torch.tensor([p])).logits[0, 0].item() for p in pairs])
    np.testing.assert_allclose(got, reference, atol=1e-3)
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True) and sorted(r["index"] for r in body["results"]) == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == sum(map(len, pairs)) and body["model"] == MODEL
    one_by_one = [post(server, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": [doc]}).json()
                  ["results"][0]["relevance_score"] for doc in DOCUMENTS]
    np.testing.assert_allclose(got, one_by_one, atol=1e-4)
    top = post(server, "/v1/rerank", {"model": MODEL, "query": QUERY, "top_n": 2, "return_documents": True,
                                      "documents": [{"text": d} for d in DOCUMENTS]}).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in body["results"][:2]]
    assert [r["document"]["text"] for r in top] == [DOCUMENTS[r["index"]] for r in top]


def test_generation_routes_and_embeddings_refuse_a_reranker_by_name(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
                       ("/v1/responses", {"model": MODEL, "input": "hi"}), ("/v1/messages", chat)):
        refused = post(server, path, body)
        assert refused.status_code == 400, (path, refused.text)
        error = refused.json()["error"]
        assert "is an embedding model" in error["message"] and path in error["message"]
        if path == "/v1/messages":
            assert refused.json()["type"] == "error"  # in Anthropic's shape there
    counted = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": chat["messages"]})
    assert counted.status_code == 400 and "no chat template" in counted.json()["error"]["message"]
    embed = post(server, "/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert embed.status_code == 400 and "/v1/rerank" in embed.json()["error"]["message"]
    bad = post(server, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": ["ok", 7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents[1]"
    long = post(server, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": ["cat " * 200]})
    assert long.status_code == 400 and long.json()["error"]["param"] == "documents"


def test_models_and_health_say_what_is_served(server):
    card = httpx.get(server.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]
    assert card["id"] == MODEL and card["task"] == "rerank" and card["pooling"] == "rank"
    health = server.health()
    assert health["status"] == "ok" and health["task"] == "rerank"
    assert "decode_engine" not in health["components"] and set(health["processes"]) == {"prefill-0"}


def test_keys_filters_limits_audit_and_metrics(server):
    body = {"model": MODEL, "query": QUERY, "documents": ["the cat"], "priority": -3}
    assert post(server, "/v1/rerank", body, key=None).status_code == 401
    assert post(server, "/v1/rerank", body, key="wrong").status_code == 401
    filtered = post(server, "/v1/rerank", {**body, "documents": ["a forbidden word"]})
    assert filtered.status_code == 403  # the content filters read the documents
    assert post(server, "/v1/rerank", body, key=LIMITED_KEY).status_code == 200
    assert post(server, "/v1/rerank", body, key=LIMITED_KEY).status_code == 429

    def audited() -> list[dict]:
        return [e for e in map(json.loads, server.audit.read_text().splitlines()) if e["kind"] == "rerank"]
    assert wait_for(lambda: any(e["priority"] == -3 and e["status"] == "finished" for e in audited()), timeout_s=10)
    assert any(e["status"] == "rejected" and e["http_status"] == 429 for e in audited())
    assert server.metric("edge:api_requests_total", route="/v1/rerank", status="finished") >= 1
