"""End to end: Ollama's API (/api/...) on the real service (embedded model), driven by the `ollama` Python client from
PyPI (list, show, chat and generate plain and streamed, embed, ps, the refusals), and the stream's bytes checked line
by line against Ollama's documented format (docs/api.md in ollama/ollama). Keys, priorities, the audit log and the
route metrics as on the OpenAI routes. One server for the module (tests/e2e/conftest.py)."""

import json
from datetime import UTC, datetime

import httpx
import numpy as np
import ollama
import pytest

from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEY, LOW_KEY, LIMITED_KEY = "api-key", "low-key", "limited-key"
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
[classes.low]
priority = 5
[[keys]]
key = "{KEY}"
class = "standard"
[[keys]]
key = "{LOW_KEY}"
class = "low"
[[keys]]
key = "{LIMITED_KEY}"
class = "standard"
requests_per_minute = 1
"""
GREEDY = {"temperature": 0, "num_predict": 12, "seed": 7}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Ollama's documented objects: a streamed chunk's keys, the final object's, its counts and durations
CHAT_CHUNK_KEYS = {"model", "created_at", "message", "done"}
GENERATE_CHUNK_KEYS = {"model", "created_at", "response", "done"}
FINAL_NUMBERS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                 "eval_duration")


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def raw_lines(server, path: str, body: dict, key: str = KEY) -> tuple[httpx.Response, list[dict]]:
    with httpx.stream("POST", server.base + path, json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120) as response:
        lines = [json.loads(line) for line in response.iter_lines() if line]
    return response, lines


def rfc3339(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_list_and_show(client):
    listed = client.list().models
    assert [m.model for m in listed] == [f"{MODEL}:latest"]
    entry = listed[0]
    assert entry.size > 50_000_000 and len(entry.digest) == 64
    assert (entry.details.format, entry.details.family, entry.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert entry.details.parameter_size == "134.52M"
    shown = client.show(MODEL)
    assert shown.details.family == "llama" and shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.block_count"] == 30
    assert shown.modelinfo["tokenizer.ggml.tokens"] == []  # long arrays only with verbose, as Ollama
    assert "<|im_start|>" in shown.template
    assert client.show(f"{MODEL}:latest").details == shown.details


def test_chat_plain_and_streamed_agree(client):
    plain = client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=False)
    assert plain.done and plain.done_reason in ("stop", "length") and plain.message.role == "assistant"
    assert plain.message.content and plain.model == MODEL
    assert 0 < plain.eval_count <= 12 and plain.prompt_eval_count > 5
    assert plain.total_duration >= plain.prompt_eval_duration + plain.eval_duration > 0
    assert plain.load_duration >= 0 and plain.prompt_eval_duration > 0
    chunks = list(client.chat(model=f"{MODEL}:latest", messages=QUESTION, options=GREEDY, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == plain.message.content  # greedy: the same answer
    last = chunks[-1]
    assert last.message.content == "" and last.done_reason == plain.done_reason
    assert last.eval_count == plain.eval_count and last.model == f"{MODEL}:latest"


def test_generate_plain_streamed_and_raw(client):
    plain = client.generate(model=MODEL, prompt="Name a color.", options=GREEDY)
    assert plain.done and plain.response and 0 < plain.eval_count <= 12
    chunks = list(client.generate(model=MODEL, prompt="Name a color.", options=GREEDY, stream=True))
    assert chunks[-1].done and chunks[-1].response == ""
    assert "".join(c.response for c in chunks) == plain.response
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    assert raw.response and raw.prompt_eval_count < plain.prompt_eval_count  # no chat template around it


def test_stream_bytes_match_ollamas_format(server):
    response, lines = raw_lines(server, "/api/chat", {"model": MODEL, "messages": QUESTION, "options": GREEDY})
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
    *chunks, final = lines
    for chunk in chunks:
        assert set(chunk) == CHAT_CHUNK_KEYS and chunk["done"] is False
        assert set(chunk["message"]) == {"role", "content"} and chunk["message"]["role"] == "assistant"
        assert rfc3339(chunk["created_at"]).tzinfo is not None
    assert set(final) == CHAT_CHUNK_KEYS | {"done_reason", *FINAL_NUMBERS} and final["done"] is True
    assert final["message"] == {"role": "assistant", "content": ""}
    assert all(isinstance(final[name], int) and final[name] >= 0 for name in FINAL_NUMBERS)
    assert final["eval_count"] >= len(chunks) > 0  # a chunk per engine event that carried text
    response, lines = raw_lines(server, "/api/generate", {"model": MODEL, "prompt": "Hi", "options": GREEDY})
    assert response.headers["content-type"] == "application/x-ndjson"
    assert all(set(line) == GENERATE_CHUNK_KEYS for line in lines[:-1])
    assert set(lines[-1]) == GENERATE_CHUNK_KEYS | {"done_reason", *FINAL_NUMBERS}
    plain = httpx.post(server.base + "/api/chat", json={"model": MODEL, "messages": QUESTION, "options": GREEDY,
                                                        "stream": False},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert plain.headers["content-type"].startswith("application/json")
    assert "".join(c["message"]["content"] for c in chunks) == plain.json()["message"]["content"]


def test_options_format_and_logprobs(client):
    capped = client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 3, "temperature": 0})
    assert capped.eval_count == 3 and capped.done_reason == "length"
    stopped = client.generate(model=MODEL, prompt="Count: 1, 2, 3,", raw=True,
                              options={"temperature": 0, "num_predict": 20, "stop": [","]})
    assert "," not in stopped.response and stopped.done_reason == "stop"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    shaped = client.chat(model=MODEL, messages=QUESTION, format=schema, options={"temperature": 0, "num_predict": 40})
    assert shaped.done_reason == "stop" and isinstance(json.loads(shaped.message.content)["city"], str)
    scored = client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 4}, logprobs=True, top_logprobs=2)
    assert len(scored.logprobs) >= 3 and all(len(entry.top_logprobs) == 2 for entry in scored.logprobs)
    assert all(entry.logprob <= 0 for entry in scored.logprobs)


def test_embed(client):
    texts = ["The cat sat on the mat.", "A kitten was sitting on the rug.", "Quarterly taxes are due in April."]
    answer = client.embed(model=MODEL, input=texts)
    vectors = np.array(answer.embeddings)  # [3, n_embd]
    assert vectors.shape == (3, 576) and answer.prompt_eval_count > 10 and answer.total_duration > 0
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosine = vectors @ vectors.T
    assert cosine[0, 1] > cosine[0, 2] and cosine[0, 1] > cosine[1, 2]
    alone = np.array(client.embed(model=MODEL, input=texts[0]).embeddings[0])
    assert np.abs(alone - vectors[0]).max() < 5e-3
    older = np.array(client.embeddings(model=MODEL, prompt=texts[0]).embedding)
    assert np.abs(older - alone).max() < 5e-3


def test_ps_lists_the_loaded_model(client):
    running = client.ps().models
    assert [m.model for m in running] == [f"{MODEL}:latest"]
    assert running[0].size > 100_000_000 and running[0].expires_at > datetime.now(UTC)
    assert running[0].context_length == 1200 and running[0].details.quantization_level == "Q4_1"


def test_model_management_is_refused(client):
    for attempt in (lambda: client.pull(MODEL), lambda: client.push(MODEL), lambda: client.create("copy", MODEL),
                    lambda: client.copy(MODEL, "other"), lambda: client.delete(MODEL)):
        with pytest.raises(ollama.ResponseError) as refused:
            attempt()
        assert refused.value.status_code == 403 and "config" in refused.value.error


def test_errors_in_ollamas_shape(server, client):
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="llama3.2", messages=QUESTION)
    assert unknown.value.status_code == 404 and "llama3.2" in unknown.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(model=MODEL, messages=QUESTION, options={"temperature": 9})
    assert bad.value.status_code == 400 and "options.temperature" in bad.value.error
    with pytest.raises(ollama.ResponseError) as thinking:
        client.chat(model=MODEL, messages=QUESTION, think=True)
    assert thinking.value.status_code == 400 and "thinking" in thinking.value.error
    stranger = ollama.Client(host=server.base, headers={"Authorization": "Bearer wrong"})
    for attempt in (lambda: stranger.list(), lambda: stranger.chat(model=MODEL, messages=QUESTION),
                    lambda: stranger.embed(model=MODEL, input="x"), lambda: stranger.show(MODEL)):
        with pytest.raises(ollama.ResponseError) as denied:
            attempt()
        assert denied.value.status_code == 401
    with pytest.raises(ollama.ResponseError) as blocked:
        client.generate(model=MODEL, prompt="say forbidden")
    assert blocked.value.status_code == 403  # the policy's content filter, as on every route
    answer = httpx.post(server.base + "/api/chat", json={"model": MODEL, "messages": "hi"},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert answer.status_code == 400 and set(answer.json()) == {"error"}


def test_load_requests(client):
    loaded = client.chat(model=MODEL, messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""
    assert client.generate(model=MODEL, prompt="").done_reason == "load"
    with pytest.raises(ollama.ResponseError) as unload:
        client.generate(model=MODEL, prompt="", keep_alive=0)
    assert unload.value.status_code == 400 and "unloaded" in unload.value.error


def test_keys_quota_audit_and_metrics(server, audit_lines):
    limited = ollama.Client(host=server.base, headers={"Authorization": f"Bearer {LIMITED_KEY}"}, timeout=120)
    limited.chat(model=MODEL, messages=QUESTION, options={"num_predict": 2})
    with pytest.raises(ollama.ResponseError) as throttled:
        limited.chat(model=MODEL, messages=QUESTION, options={"num_predict": 2})
    assert throttled.value.status_code == 429
    low = httpx.post(server.base + "/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False,
                                                          "options": {"num_predict": 2}},
                     headers={"Authorization": f"Bearer {LOW_KEY}"}, timeout=120)
    assert low.status_code == 200 and low.headers["X-Edge-Class"] == "low"
    routes = {(r["route"], r["status"]) for r in audit_lines()}
    assert {("/api/chat", "finished"), ("/api/generate", "finished"), ("/api/embed", "finished"),
            ("/api/chat", "rejected")} <= routes
    for route in ("/api/chat", "/api/generate", "/api/embed"):
        assert server.metric("edge:api_requests_total", route=route, status="finished") >= 1


def test_several_models_through_the_ollama_client(tmp_path, embedded_model_path):
    """[[models]]: /api/tags lists both, /api/ps the loaded ones with their keep_alive's expiry; a chat loads its
    model (the wait is its load_duration), a load request with keep_alive 0 unloads it, the pinned one stays."""
    config = (f'kv_cache_tokens = 4096\nmax_model_len = 1024\nprefill_workers = 1\n\n[[models]]\nname = "smol"\n'
              f'model = "{embedded_model_path}"\npinned = true\n\n[[models]]\nname = "smol-b"\n'
              f'model = "{embedded_model_path}"\nkeep_alive = "10m"\n')
    with ServerProcess(config, tmp_path).start() as server:
        client = ollama.Client(host=server.base, timeout=600)
        assert [m.model for m in client.list().models] == ["smol:latest", "smol-b:latest"]
        assert [m.model for m in client.ps().models] == ["smol:latest"]
        answer = client.chat(model="smol-b:latest", messages=QUESTION, options={"num_predict": 3})
        assert answer.model == "smol-b:latest" and answer.eval_count == 3
        assert answer.load_duration > answer.prompt_eval_duration  # it waited for smol-b's load
        running = {m.model: m for m in client.ps().models}
        assert set(running) == {"smol:latest", "smol-b:latest"} and running["smol-b:latest"].size > 100_000_000
        expires = (running["smol-b:latest"].expires_at - datetime.now(UTC)).total_seconds()
        assert 500 < expires <= 600 and running["smol:latest"].expires_at.year > 2200  # 10m; pinned: never
        assert client.generate(model="smol-b", prompt="", keep_alive=0).done_reason == "unload"
        assert wait_for(lambda: [m.model for m in client.ps().models] == ["smol:latest"], 60)
        with pytest.raises(ollama.ResponseError) as pinned:
            client.generate(model="smol", prompt="", keep_alive=0)
        assert pinned.value.status_code == 400 and "pinned" in pinned.value.error
