"""Through `edge serve`: after a restart with the same model and config, a document seen before comes back from the
disk tier (issue 46 item 3). Checked by the tokens computed, not by the time: a restore that silently restored
nothing (a llama.cpp bug once did) would compute the whole prompt again and fail here."""

import httpx
import pytest

from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
CONFIG = """
kv_cache_tokens = 4096
max_model_len = 1200
kv_type = "f16"
kv_disk_bytes = 268435456
kv_disk_dir = "{disk}"
"""
DOCUMENT = " ".join(f"Line {i}: the depot in region {i % 7} shipped {i * 13 % 97} crates on day {i % 30}."
                    for i in range(24))


def _ask(server, question: str) -> dict:
    messages = [{"role": "system", "content": "Answer from the document in one sentence."},
                {"role": "user", "content": f"{DOCUMENT}\n\nQuestion: {question}"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _disk(server) -> dict:
    return next(iter(server.health()["prefill"].values()))["cache_tiers"].get("disk", {})


def test_a_document_seen_before_the_restart_is_restored_from_disk(tmp_path):
    config = CONFIG.format(disk=tmp_path / "kv")
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with ServerProcess(config, tmp_path / "first").start() as server:
        cold = _ask(server, "Which region shipped the most?")
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert wait_for(lambda: _disk(server).get("entries", 0) >= 1, timeout_s=60, interval=0.2), _disk(server)
    # the same config and folder; a new gateway, worker and engine: nothing in RAM
    with ServerProcess(config, tmp_path / "second").start() as server:
        assert _disk(server).get("entries", 0) >= 1  # the index was rebuilt from the files' headers
        same = _ask(server, "Which region shipped the most?")
        other = _ask(server, "On which day did line 5 ship?")
        disk = _disk(server)
    prompt = cold["usage"]["prompt_tokens"]
    # the same prompt: every token restored (the stored last logits draw the first token): the same greedy text
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt, same["usage"]
    assert same["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    # another question: the document's prefix restored (the stored entry is the first prompt, or the first prompt
    # and its answer), only the new question computed
    computed = other["usage"]["prompt_tokens"] - other["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert computed <= 24, other["usage"]
    assert disk["hits"] >= 1, disk
