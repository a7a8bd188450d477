"""Through `edge serve`: DELETE /v1/kv_cache?key= forgets one tenant's cached prompts, in the worker's RAM prompt cache
and its disk tier: that tenant's next request computes its whole prompt, while another tenant's same prompt still
hits (issue 46 item 4)."""

import httpx
import pytest

from server_process import ServerProcess, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
A, B, ADMIN = "tenant-a-key", "tenant-b-key", "operator-key"
CONFIG = """
kv_cache_tokens = 4096
max_model_len = 1200
kv_type = "f16"
kv_disk_bytes = 268435456
kv_disk_dir = "{disk}"
"""
POLICY = "version = 1\ndefault_class = \"standard\"\n[classes.standard]\npriority = 0\n" + "".join(
    f'[[keys]]\nkey = "{key}"\nclass = "standard"\n' for key in (A, B)) + \
    f'[[keys]]\nkey = "{ADMIN}"\nclass = "standard"\nadmin = true\n'
PROMPT = [{"role": "system", "content": "You are the support desk of a shipping company. Answer in one sentence."},
          {"role": "user", "content": "A parcel to Oslo has shown 'in transit' for nine days. What should I do?"}]


def _ask(server, key: str) -> dict:
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 2, "temperature": 0}
    reply = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def _tier(server, name: str, field: str) -> int:
    return sum(w["cache_tiers"].get(name, {}).get(field, 0) for w in server.health()["prefill"].values())


def _settled(server, answers: int, files: int) -> bool:
    """Every answer's returned KV kept or dropped (a keep after the delete would put the entry back), and the disk
    tier's writes done."""
    return _tier(server, "returned", "hits") + _tier(server, "returned", "misses") >= answers and \
        _tier(server, "disk", "entries") >= files


def test_a_deleted_tenants_next_request_misses_and_another_tenants_still_hits(tmp_path):
    config = CONFIG.format(disk=tmp_path / "kv")
    with ServerProcess(config, tmp_path, POLICY).start() as server:
        cold_a, cold_b = _ask(server, A), _ask(server, B)
        assert _cached(cold_a) == 0 and _cached(cold_b) == 0  # B never hits A's entry: its own salt
        assert wait_for(lambda: _settled(server, 2, 2), timeout_s=60, interval=0.2), server.health()["prefill"]
        warm_a = _ask(server, A)
        assert _cached(warm_a) >= warm_a["prompt_tokens"] - 1, warm_a  # cached before the delete
        assert wait_for(lambda: _settled(server, 3, 2), timeout_s=60, interval=0.2), server.health()["prefill"]

        user = httpx.delete(server.base + "/v1/kv_cache", params={"key": A}, timeout=30,
                            headers={"Authorization": f"Bearer {A}"})
        assert user.status_code == 403, user.text  # a tenant's own key is no operator's
        deleted = httpx.delete(server.base + "/v1/kv_cache", params={"key": A}, timeout=30,
                               headers={"Authorization": f"Bearer {ADMIN}"})
        assert deleted.status_code == 200, deleted.text
        counts = deleted.json()["deleted"]
        assert counts["entries"] >= 1 and counts["files"] >= 1, deleted.json()  # RAM and disk both held A's

        after_a = _ask(server, A)
        assert _cached(after_a) == 0, after_a  # neither the RAM cache nor a disk file stood in for it
        after_b = _ask(server, B)
        assert _cached(after_b) >= after_b["prompt_tokens"] - 1, after_b  # B's entries were not touched
