"""End to end: embeddings, prompt logprobs and tokenize/detokenize on the real service (embedded model), driven by
the openai client and raw HTTP; their keys, quotas, priorities and audit lines. One server for the module
(tests/e2e/conftest.py)."""

import base64

import httpx
import numpy as np
import openai
import pytest

from server_process import wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY, QUOTA_KEY = "api-key", "quota-key"
CONFIG = """
kv_cache_tokens = 8192
max_model_len = 1200
"""
POLICY = f"""
version = 1
default_class = "standard"
[filters]
max_prompt_tokens = 1024
max_output_tokens = 512
blocked_words = ["forbidden"]
[classes.standard]
priority = 0
[[keys]]
key = "{KEY}"
class = "standard"
[[keys]]
key = "{QUOTA_KEY}"
class = "standard"
requests_per_minute = 1
"""
RELATED = ("The cat sat on the mat.", "A kitten was sitting on the rug.")
UNRELATED = "Quarterly tax filings are due in April."
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin, and its river is the Spree."
# prompt logprobs against transformers on the same tokens (teacher-forced): the bounds of
# tests/prefill_cpu/test_prompt_logprobs.py, measured there
MEAN_BOUND, MAX_BOUND = 0.1, 0.6


def post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base + path, json=body, headers=headers, timeout=120)


def test_embeddings_with_the_openai_client(server, oai):
    texts = [*RELATED, UNRELATED]
    batch = oai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    vectors = np.array([d.embedding for d in batch.data])  # [3, n_embd]
    assert [d.index for d in batch.data] == [0, 1, 2] and vectors.shape == (3, 576)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 10
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosine = vectors @ vectors.T
    assert cosine[0, 1] > cosine[0, 2] and cosine[0, 1] > cosine[1, 2]  # the related pair ranks first
    alone = np.array([oai.embeddings.create(model=MODEL, input=t, encoding_format="float").data[0].embedding
                      for t in texts])
    assert np.abs(alone - vectors).max() < 5e-3  # a batch equals one by one (measured 7.5e-4)
    packed = post(server, "/v1/embeddings", {"model": MODEL, "input": texts, "encoding_format": "base64"}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]])
    np.testing.assert_array_equal(decoded, vectors.astype(np.float32))
    tokens = post(server, "/tokenize", {"model": MODEL, "prompt": texts[0]}).json()["tokens"]
    by_tokens = oai.embeddings.create(model=MODEL, input=[tokens], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(by_tokens, alone[0], atol=1e-6)  # the same tokens as the text


def test_what_cannot_be_honoured_is_refused(server, oai):
    assert len(oai.embeddings.create(model=MODEL, input="x", dimensions=576).data[0].embedding) == 576
    with pytest.raises(openai.BadRequestError) as caught:
        oai.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert caught.value.body["param"] == "dimensions"
    refused = post(server, "/v1/embeddings", {"model": MODEL, "input": "a forbidden word"})
    assert refused.status_code == 403  # the policy's content filters read the inputs
    rerank = post(server, "/v1/rerank", {"model": MODEL, "query": "cat", "documents": ["a", "b"]})
    assert rerank.status_code == 400 and "no rank head" in rerank.json()["error"]["message"]


def test_prompt_logprobs_match_transformers(server):
    import torch

    from contracts.identity import read_gguf_identity
    from decode_gpu.model.loader import load_decode_model
    from prefill_cpu.embedded_model import embedded_model_path
    echo = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1,
                                            "max_tokens": 0, "temperature": 0}).json()
    choice = echo["choices"][0]
    tokens = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    scores = choice["logprobs"]["token_logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length" and echo["usage"]["completion_tokens"] == 0
    assert len(scores) == len(tokens) and scores[0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert "".join(choice["logprobs"]["tokens"]) == PROMPT
    model = load_decode_model(read_gguf_identity(embedded_model_path()), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)  # [n, vocab]
    expected = reference[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    difference = np.abs(np.array(scores[1:]) - expected)
    assert difference.mean() < MEAN_BOUND and difference.max() < MAX_BOUND, (difference.mean(), difference.max())
    # vLLM's prompt_logprobs, on the token ids, with a generated token after: the same numbers, and the top 3
    vllm = post(server, "/v1/completions", {"model": MODEL, "prompt": tokens, "prompt_logprobs": 3,
                                            "max_tokens": 2, "temperature": 0}).json()["choices"][0]
    entries = vllm["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(tokens)
    for position, token, score in zip(entries[1:], tokens[1:], scores[1:]):
        assert position[str(token)]["logprob"] == pytest.approx(score, abs=1e-4)
        assert 3 <= len(position) <= 4 and sorted(p["rank"] for p in position.values())[:3] == [1, 2, 3]
    generated = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1,
                                                 "max_tokens": 2, "temperature": 0}).json()["choices"][0]
    assert len(generated["logprobs"]["token_logprobs"]) == len(tokens) + 2  # the prompt's, then the output's
    assert generated["logprobs"]["token_logprobs"][0] is None
    assert generated["logprobs"]["token_logprobs"][1:len(tokens)] == pytest.approx(scores[1:], abs=1e-4)


def test_tokenize_and_detokenize_round_trip(server):
    text = "Hello, world: tokens and back again."
    tokenized = post(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 3 and tokenized["max_model_len"] == 1200
    assert post(server, "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]}).json() == {"prompt": text}
    chat = post(server, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": text}]}).json()
    assert chat["count"] > tokenized["count"]  # the chat template's turn markers
    usage = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}],
                                                  "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]  # what the worker prefilled
    bad = post(server, "/detokenize", {"model": MODEL, "tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"


def test_keys_quota_priority_and_audit(server, audit_lines):
    body = {"model": MODEL, "input": "hello there", "priority": -5}
    for path, request in (("/v1/embeddings", body), ("/tokenize", {"model": MODEL, "prompt": "hi"}),
                          ("/detokenize", {"model": MODEL, "tokens": [1]}), ("/v1/rerank", {"model": MODEL})):
        assert post(server, path, request, key=None).status_code == 401, path
        assert post(server, path, request, key="wrong").status_code == 401, path
    assert post(server, "/v1/embeddings", body, key=QUOTA_KEY).status_code == 200
    over = post(server, "/v1/embeddings", body, key=QUOTA_KEY)
    assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"

    def audited() -> list[dict]:
        return [e for e in audit_lines() if e["kind"] == "embedding"]
    assert wait_for(lambda: any(e["priority"] == -5 and e["status"] == "finished" for e in audited()), timeout_s=10)
    assert any(e["status"] == "rejected" and e["http_status"] == 429 for e in audited())
