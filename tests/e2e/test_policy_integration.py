"""Against the real server with a low-threshold policy: load moves it into a tier, responses show the
tier's actions, it returns to normal when the load stops, and the policy file hot-reloads."""

import os
import signal
import threading

import httpx
import pytest

from server_process import served, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct.Q4_1"
CONFIG = """
kv_cache_tokens = 2048
[limits]
shutdown_grace_s = 1.0
"""
POLICY = """
version = 1
default_class = "standard"
[classes.standard]
priority = 0
[classes.background]
priority = 10
[tenants]
header = "X-Tenant"
[tenants.classes]
nightly = "background"
[[tiers]]
name = "loaded"
min_dwell_s = 1
enter = { kv_cache_usage = 0.25 }
exit = { kv_cache_usage = 0.1 }
[tiers.actions]
cap_max_tokens = 4
logprobs = "refuse"
shed_classes = ["background"]
retry_after_s = 3
"""
# counting: greedy decoding continues it for as long as it is let, whatever the decode dtype's rounding (an essay
# prompt ended with EOS after ~60 tokens in bfloat16, before the load reached the tier)
LOAD_PROMPT = "Counting: " + ", ".join(str(i) for i in range(1, 31)) + ","


server = served(CONFIG, POLICY, "policy-serve")


def complete(server, headers=None, **body):
    return httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "Hello there", **body},
                      headers=headers or {}, timeout=120)


def tier(server) -> str:
    return server.health()["policy"]["tier"]


class Load:
    """Streams that hold KV blocks until stopped."""

    def __init__(self, server, n: int) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._stream, args=(server,)) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _stream(self, server) -> None:
        body = {"model": MODEL, "prompt": LOAD_PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=300) as response:
            for _ in response.iter_lines():
                if self.stop.is_set():
                    return

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_load_enters_the_tier_applies_its_actions_and_leaves(server):
    normal = complete(server, max_tokens=8, temperature=0)
    assert normal.status_code == 200 and normal.headers["X-Edge-Tier"] == "normal"
    assert normal.json()["usage"]["completion_tokens"] == 8
    load = Load(server, 3)
    try:
        assert wait_for(lambda: tier(server) == "loaded", 90), server.health()
        assert "kv_cache_usage" in server.health()["policy"]["reason"]
        capped = complete(server, max_tokens=50, temperature=0)
        assert capped.status_code == 200
        assert capped.json()["usage"]["completion_tokens"] == 4
        assert capped.json()["choices"][0]["finish_reason"] == "length"
        assert capped.headers["X-Edge-Tier"] == "loaded" and "max_tokens 50->4" in capped.headers["X-Edge-Degraded"]
        refused = complete(server, max_tokens=5, logprobs=2)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "logprobs_unavailable"
        shed = complete(server, headers={"X-Tenant": "nightly"}, max_tokens=5)
        assert shed.status_code == 429 and shed.headers["Retry-After"] == "3"
        assert shed.json()["error"]["code"] == "shed_under_load"
        assert server.metric("edge:degradation_tier") == 1
    finally:
        load.end()
    assert wait_for(lambda: tier(server) == "normal", 30), server.health()
    after = complete(server, max_tokens=8, temperature=0, logprobs=1)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
    assert "X-Edge-Degraded" not in after.headers
    assert complete(server, headers={"X-Tenant": "nightly"}, max_tokens=2).status_code == 200


def test_policy_file_hot_reloads_and_a_bad_file_is_refused(server):
    server.policy.write_text(POLICY.replace("[filters]", "") + '\n[filters]\nblocked_words = ["pineapple"]\n')
    assert wait_for(lambda: complete(server, prompt="I like PINEAPPLE", max_tokens=2).status_code == 403, 10)
    server.policy.write_text(POLICY + "\nthis is not toml\n")
    assert wait_for(lambda: server.health()["policy"]["last_reload_error"] is not None, 10)
    assert complete(server, prompt="I like pineapple", max_tokens=2).status_code == 403  # old policy still in force
    server.policy.write_text('allow_weaker_protection = ["blocked_content"]\n' + POLICY)  # drops pineapple
    os.kill(server.process.pid, signal.SIGHUP)
    assert wait_for(lambda: complete(server, prompt="I like pineapple", max_tokens=2).status_code == 200, 10)
    assert server.health()["policy"]["last_reload_error"] is None
