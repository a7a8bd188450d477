"""End to end: the same request with the same seed gives the same text twice in a row on an idle server, for
completions and chat, one choice and three. The first call of each prompt is a miss of the prefill worker's prompt
cache and the second a hit, so this holds the two to the same KV and first-token logits (prefill_cpu.prefiller)."""

import json

import httpx
import openai
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# the prompt cache on, as served by default; one weight precision, pinned (auto's plan may hold two and switch between
# them by batch size, and its live switch may move the cut-off between two calls: docs/decode.md)
CONFIG = 'kv_cache_tokens = 8192\nmax_model_len = 1200\nweight_dtype = "float32"\n[limits]\nshutdown_grace_s = 1.0\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(CONFIG, tmp_path_factory.mktemp("seeds")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def worker_hits(server) -> float:
    try:
        return server.metric("vllm:prefix_cache_hits_total", where="worker")
    except KeyError:  # no hit yet
        return 0.0


def twice(server, ask) -> tuple[list[str], list[str]]:
    """Two identical calls: the first computes its prompt past what other tests' prompts share with it (a miss of
    the last token at least), the second finds all of it in the prompt cache. ask: () -> (texts, prompt tokens)."""
    before = worker_hits(server)
    first, prompt_tokens = ask()
    middle = worker_hits(server)
    assert middle - before < prompt_tokens, "the first call must compute its prompt"
    second, _ = ask()
    assert worker_hits(server) - middle == prompt_tokens, "the second call must find all its prompt in the cache"
    return first, second


@pytest.mark.parametrize("n", [1, 3])
def test_seeded_completions_repeat(server, client, n):
    def ask():
        completion = client.completions.create(model=MODEL, prompt=f"Once upon a time, {n} friends", n=n,
                                               max_tokens=24, temperature=1.0, seed=42)
        return [c.text for c in sorted(completion.choices, key=lambda c: c.index)], completion.usage.prompt_tokens
    first, second = twice(server, ask)
    assert first == second and len(first) == n
    assert len(set(first)) == n  # each choice its own stream


@pytest.mark.parametrize("n", [1, 3])
def test_seeded_chat_repeats(server, client, n):
    def ask():
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me a story about {n} cats."}], n=n,
            max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
        return [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)], chat.usage.prompt_tokens
    first, second = twice(server, ask)
    assert first == second and len(first) == n
    assert len(set(first)) == n


def test_a_streamed_seeded_answer_is_the_unstreamed_one(server):
    """The same seed streamed gives the same text as the last unstreamed call (the prompt cache holds it now)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about 1 cats."}],
            "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 7}
    plain = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120).json()
    text = ""
    with httpx.stream("POST", server.base + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    assert text == plain["choices"][0]["message"]["content"]
