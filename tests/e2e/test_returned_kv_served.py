"""Through `edge serve`: the second turn of a chat prefills only its new tokens, because the engine returned the first
answer's KV to the worker, and its greedy text is the text served with the return off."""

import httpx
import pytest

from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
CONFIG = """
kv_cache_tokens = 4096
max_model_len = 1200
kv_type = "f16"
"""
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three things an operator should check when a server is slow."}]


def _chat(server, messages, max_tokens):
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _returned(server) -> int:
    """The answers' KV the workers kept, as their heartbeats tell /health."""
    return sum(w["cache_tiers"].get("returned", {}).get("hits", 0) for w in server.health()["prefill"].values())


def _two_turns(server, returning: bool):
    first = _chat(server, QUESTION, 40)
    if returning:  # the worker keeps the answer's KV between jobs: the next turn is sent once it has
        assert wait_for(lambda: _returned(server) >= 1, timeout_s=30, interval=0.2), server.health()["prefill"]
    answer = first["choices"][0]["message"]["content"]
    messages = QUESTION + [{"role": "assistant", "content": answer},
                           {"role": "user", "content": "Which of those is the quickest to check?"}]
    second = _chat(server, messages, 16)
    return first, second


def test_turn_two_prefills_only_its_new_tokens_with_the_same_text(tmp_path):
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    with ServerProcess(CONFIG, tmp_path / "on").start() as server:
        first, ours = _two_turns(server, returning=True)
        tiers = server.health()["prefill"]
    with ServerProcess(CONFIG + "kv_return_bytes = 0\n", tmp_path / "off").start() as server:
        _, theirs = _two_turns(server, returning=False)
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    cached_ours = ours["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached_theirs = theirs["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt_1, answer_1 = first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]
    # off: only turn 1's prompt is cached; on: its answer too (all but its last token, plus what the template
    # renders differently), so turn 2 computes about the new message alone
    assert cached_theirs <= prompt_1
    assert cached_ours >= prompt_1 + answer_1 - 4, (cached_ours, prompt_1, answer_1, tiers)
    print(f"turn 2: {ours['usage']['prompt_tokens']} prompt tokens, cached {cached_ours} with the return, "
          f"{cached_theirs} without; tiers {tiers}")
