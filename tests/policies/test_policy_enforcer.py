"""The enforcer applies every filter and tier action, and maps keys and tenants to classes."""

import pytest

from policies.enforcer import PolicyEnforcer, PolicyRejection, RequestFacts
from policies.loader import parse_policy

POLICY = """
version = 1
default_class = "interactive"
[filters]
max_prompt_tokens = 1000
max_output_tokens = 500
allowed_models = ["small"]
blocked_words = ["secretword"]
blocked_patterns = ["pass(word)?\\\\s*=\\\\s*\\\\d+"]
[classes.interactive]
priority = 0
degradable = ["logprobs"]
[classes.batch]
priority = 10
requests_per_minute = 2
max_concurrent = 2
max_output_tokens = 300
[classes.vip]
priority = -5
[[keys]]
key = "k-int"
class = "interactive"
[[keys]]
key = "k-batch"
class = "batch"
[[keys]]
key = "k-vip"
class = "vip"
max_concurrent = 1
[tenants]
header = "X-Tenant"
[tenants.classes]
nightly = "batch"
[[tiers]]
name = "busy"
min_dwell_s = 0
enter = { kv_cache_usage = 0.5 }
exit = { kv_cache_usage = 0.4 }
[tiers.actions]
cap_max_tokens = 64
logprobs = "strip"
max_prompt_tokens = 256
kv_type = "q4_0"
[[tiers]]
name = "peak"
min_dwell_s = 0
enter = { kv_cache_usage = 0.9 }
exit = { kv_cache_usage = 0.8 }
[tiers.actions]
cap_max_tokens = 16
logprobs = "refuse"
shed_classes = ["batch"]
retry_after_s = 7
speculative = false
"""
MODELS = {"small", "large"}


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def enforcer():
    return PolicyEnforcer(parse_policy(POLICY, "test.toml"), default_max_tokens=100, clock=Clock())


def facts(key="k-int", tenant=None, model="small", text="hello", max_tokens=None, logprobs=None):
    return RequestFacts(key, tenant, model, text, max_tokens, logprobs)


def rejection(enforcer, **kw) -> PolicyRejection:
    with pytest.raises(PolicyRejection) as info:
        enforcer.decide(facts(**kw), MODELS)
    return info.value


def test_keys_and_tenants_map_to_classes(enforcer):
    assert enforcer.decide(facts("k-batch"), MODELS).client_class == "batch"
    assert enforcer.decide(facts("k-vip"), MODELS).priority == -5
    assert enforcer.decide(facts("k-int", tenant="nightly"), MODELS).client_class == "interactive"  # key wins


def test_tenant_header_maps_when_no_keys_are_configured():
    policy = parse_policy(POLICY.split("[[keys]]")[0] + POLICY[POLICY.index("[tenants]"):], "t.toml")
    enforcer = PolicyEnforcer(policy)
    assert enforcer.decide(facts(None, tenant="nightly"), MODELS).client_class == "batch"
    assert enforcer.decide(facts(None), MODELS).client_class == "interactive"


def test_filters(enforcer):
    assert rejection(enforcer, key=None).status == 401
    assert rejection(enforcer, key="nope").code == "invalid_api_key"
    assert rejection(enforcer, model="large").code == "model_not_found"  # served, but not allowed
    assert rejection(enforcer, model="large").status == 404  # as OpenAI and Anthropic answer: the SDKs' NotFoundError
    assert rejection(enforcer, text="my SecretWord").status == 403
    assert rejection(enforcer, text="PASSWORD = 1234").status == 403
    assert rejection(enforcer, max_tokens=501).param == "max_tokens"
    assert rejection(enforcer, key="k-batch", max_tokens=301).status == 400  # class limit below the filter
    decision = enforcer.decide(facts(), MODELS)
    assert decision.max_tokens == 100 and decision.max_prompt_tokens == 1000 and decision.tier == "normal"


def test_rate_limit_and_concurrency_per_class_and_key(enforcer):
    first = enforcer.decide(facts("k-batch"), MODELS)
    enforcer.decide(facts("k-batch"), MODELS)
    assert rejection(enforcer, key="k-batch").code == "concurrency_limit"
    enforcer.release(first)
    limited = rejection(enforcer, key="k-batch")  # a free slot, but 2 per minute are used up
    assert limited.code == "rate_limit_exceeded" and limited.retry_after_s >= 1
    vip = enforcer.decide(facts("k-vip"), MODELS)
    assert rejection(enforcer, key="k-vip").code == "concurrency_limit"  # per-key cap
    enforcer.release(vip)
    enforcer.decide(facts("k-vip"), MODELS)


def test_busy_tier_applies_each_action_to_degradable_classes(enforcer):
    enforcer.update_signals({"kv_cache_usage": 0.6})
    batch = enforcer.decide(facts("k-batch", max_tokens=200, logprobs=3), MODELS)
    assert (batch.tier, batch.max_tokens, batch.logprobs, batch.max_prompt_tokens, batch.kv_type) == \
        ("busy", 64, None, 256, "q4_0")
    assert "max_tokens 200->64" in batch.notes and "logprobs stripped" in batch.notes
    interactive = enforcer.decide(facts("k-int", max_tokens=200, logprobs=3), MODELS)
    assert (interactive.max_tokens, interactive.logprobs, interactive.kv_type) == (200, None, "")  # only logprobs


def test_peak_tier_sheds_and_refuses(enforcer):
    enforcer.update_signals({"kv_cache_usage": 0.95})
    shed = rejection(enforcer, key="k-batch")
    assert shed.status == 429 and shed.code == "shed_under_load" and shed.retry_after_s == 7
    refused = rejection(enforcer, key="k-int", logprobs=2)
    assert refused.status == 503 and refused.code == "logprobs_unavailable"
    assert enforcer.decide(facts("k-vip", max_tokens=100), MODELS).max_tokens == 16


def test_a_tier_turns_speculative_decoding_off_while_it_holds(enforcer):
    assert enforcer.speculation_allowed
    enforcer.update_signals({"kv_cache_usage": 0.6})
    assert enforcer.speculation_allowed  # busy leaves it on
    enforcer.update_signals({"kv_cache_usage": 0.95})
    assert not enforcer.speculation_allowed
    enforcer.update_signals({"kv_cache_usage": 0.1})
    enforcer.update_signals({"kv_cache_usage": 0.1})
    assert enforcer.speculation_allowed


def test_back_to_normal_when_load_goes(enforcer):
    enforcer.update_signals({"kv_cache_usage": 0.95})
    enforcer.update_signals({"kv_cache_usage": 0.1})
    enforcer.update_signals({"kv_cache_usage": 0.1})
    assert enforcer.decide(facts(max_tokens=200), MODELS).max_tokens == 200


def test_reload_keeps_the_tier_in_force(enforcer):
    enforcer.update_signals({"kv_cache_usage": 0.6})
    enforcer.install(parse_policy(POLICY.replace("cap_max_tokens = 64", "cap_max_tokens = 32"), "new.toml"))
    assert enforcer.evaluator.state.name == "busy"
    assert enforcer.decide(facts("k-batch", max_tokens=200), MODELS).max_tokens == 32
