"""Policy per model (issue 45): a class's or key's `model_limits` (rate limits and concurrency caps, and a key's token
quotas, on one model, on top of its limits across models), validated against the models the key or class may use and
refused with a 429 that names the model and the limit; and the degradation tiers per model (each model's requests
get the tier its own load puts it in)."""

import pytest

from policies.enforcer import PolicyEnforcer, PolicyRejection, RequestFacts
from policies.limits import model_counter
from policies.loader import PolicyError, parse_policy
from policies.quota import key_id
from policies.reloader import removed_protections

POLICY = """
version = 1
default_class = "team"
[classes.team]
priority = 0
[classes.team.model_limits.big]
max_concurrent = 1                 # the class's requests for "big", all keys together
[[keys]]
key = "k1"
class = "team"
tokens_per_day = 1000
[keys.model_limits.big]
requests_per_minute = 2
tokens_per_day = 100
[[keys]]
key = "k2"
class = "team"
[[tiers]]
name = "busy"
enter = { waiting_requests = 10 }
exit = { waiting_requests = 5 }
min_dwell_s = 0
[tiers.actions]
cap_max_tokens = 8
speculative = false
"""
SERVED = {"big", "small"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def enforcer_for(text: str = POLICY, clock=None) -> PolicyEnforcer:
    return PolicyEnforcer(parse_policy(text, "p.toml"), 16, clock=clock or Clock())


def decide(enforcer: PolicyEnforcer, key: str, model: str, max_tokens: int | None = 4, text: str = "hi"):
    return enforcer.decide(RequestFacts(key, None, model, text, max_tokens, None, 1), SERVED)


def refusal(enforcer: PolicyEnforcer, key: str, model: str, **kwargs) -> PolicyRejection:
    with pytest.raises(PolicyRejection) as refused:
        decide(enforcer, key, model, **kwargs)
    return refused.value


def test_model_limits_are_read_on_keys_and_classes():
    policy = parse_policy(POLICY, "p.toml")
    big = policy.keys["k1"].model_limits["big"]
    assert (big.requests_per_minute, big.max_concurrent, big.tokens_per_day, big.tokens_per_month) == (2, 0, 100, 0)
    assert policy.classes["team"].model_limits["big"].max_concurrent == 1
    inline = parse_policy(POLICY.replace('key = "k2"', 'key = "k2"\nmodel_limits = { small = { max_concurrent = 3 } }'),
                          "p.toml")
    assert inline.keys["k2"].model_limits["small"].max_concurrent == 3


@pytest.mark.parametrize(("change", "where", "line", "expected"), [
    # a class has no token quotas (a key does), on a model as across models
    (("[classes.team.model_limits.big]", "[classes.team.model_limits.big]\ntokens_per_day = 5"),
     "classes.team.model_limits.big.tokens_per_day", 7, "unknown key"),
    (("requests_per_minute = 2", "requests_per_minute = -2"), "keys[0].model_limits.big.requests_per_minute", 13,
     "expected a value >= 0"),
    (("tokens_per_day = 100", "tokens_per_dai = 100"), "keys[0].model_limits.big.tokens_per_dai", 14,
     "unknown key"),  # the line of the key inside the array item's sub-table
    (("[classes.team]", '[filters]\nallowed_models = ["small"]\n[classes.team]'), "classes.team.model_limits.big",
     8, "this class may not use model 'big' (it may use ['small']): a limit on it would never apply"),
    (('key = "k1"', 'key = "k1"\nmodels = ["small"]'), "keys[0].model_limits.big", 13,
     "this key may not use model 'big' (it may use ['small'])"),
    (("[classes.team.model_limits.big]", '[classes.team.model_limits.""]'), "classes.team.model_limits", 6,
     "a model's name may not be empty"),
], ids=["class tokens", "negative", "misspelled", "not allowed", "not the key's", "empty name"])
def test_a_bad_model_limit_is_refused_with_its_place(change, where, line, expected):
    with pytest.raises(PolicyError) as refused:
        parse_policy(POLICY.replace(*change), "p.toml")
    issue = next(i for i in refused.value.issues if i.key == where)
    assert expected in issue.message and issue.line == line, refused.value.issues


def test_a_keys_rate_limit_on_a_model_counts_that_model_only():
    clock = Clock()
    enforcer = enforcer_for(clock=clock)
    for _ in range(2):
        enforcer.release(decide(enforcer, "k1", "big"))
    refused = refusal(enforcer, "k1", "big")
    assert (refused.status, refused.code, refused.param, refused.retry_after_s) == (429, "rate_limit_exceeded",
                                                                                    "model", 30)
    assert "rate limit of 2 requests per minute on model 'big' reached for this key" in refused.message
    for _ in range(5):  # the key's other model, and another key on the same model: not limited
        enforcer.release(decide(enforcer, "k1", "small"))
        enforcer.release(decide(enforcer, "k2", "big"))
    clock.now += 30  # one request's worth of the bucket back
    enforcer.release(decide(enforcer, "k1", "big"))


def test_a_class_concurrency_cap_on_a_model_counts_every_key_of_the_class():
    enforcer = enforcer_for()
    held = decide(enforcer, "k2", "big")
    refused = refusal(enforcer, "k1", "big")
    assert (refused.status, refused.code, refused.param) == (429, "concurrency_limit", "model")
    assert refused.message == "class has 1 requests in flight on model 'big', its limit there"
    enforcer.release(decide(enforcer, "k1", "small"))  # the other model is not capped
    enforcer.release(held)
    enforcer.release(decide(enforcer, "k1", "big"))  # the slot is back once released
    assert not +enforcer.active  # every slot released


def test_a_keys_token_quota_on_a_model_is_held_counted_and_refused_naming_it():
    # without the caps and the rate limit on big: only its quota limits it
    enforcer = enforcer_for(POLICY.replace("max_concurrent = 1 ", "max_concurrent = 0 ")
                            .replace("requests_per_minute = 2", "requests_per_minute = 0"))
    first = decide(enforcer, "k1", "big", max_tokens=90)  # 90 of the 100 on big held
    assert dict(first.quota_holds) == {key_id("k1"): 90, model_counter(key_id("k1"), "big"): 90}
    refused = refusal(enforcer, "k1", "big", max_tokens=60)
    assert (refused.status, refused.code, refused.param) == (429, "quota_exceeded", "max_tokens")
    assert "has 10 left of its tokens_per_day quota of 100 on model 'big'" in refused.message
    lowered = decide(enforcer, "k1", "big", max_tokens=None)  # none asked for: lowered to what is left on big
    assert lowered.max_tokens == 10 and "max_tokens 16->10 (quota)" in lowered.notes
    enforcer.release(first)
    enforcer.release(lowered)
    assert not enforcer.quotas.held
    record = type("Record", (), {"key_id": key_id("k1"), "model": "big", "prompt_tokens": 90,
                                 "completion_tokens": 10})()
    enforcer.count_tokens(record)  # big's 100 used, 100 of the key's 1000
    refused = refusal(enforcer, "k1", "big")
    assert (refused.status, refused.code, refused.param) == (429, "quota_exceeded", "model")
    assert "has used 100 tokens of model 'big', its tokens_per_day quota for that model is 100" in refused.message
    assert refused.retry_after_s >= 1
    enforcer.release(decide(enforcer, "k1", "small", max_tokens=500))  # the key's other models: its 900 left
    assert enforcer.quotas.current(key_id("k1")).day_tokens == 100


def test_check_room_refuses_what_decide_would_and_takes_nothing():
    enforcer = enforcer_for()
    enforcer.check_room("k1", None, "big")
    assert enforcer.rate_limiter.buckets["model:big/key:k1"].tokens == 2  # a look, not a take
    held = decide(enforcer, "k2", "big")
    with pytest.raises(PolicyRejection) as refused:
        enforcer.check_room("k1", None, "big")
    assert refused.value.code == "concurrency_limit" and "'big'" in refused.value.message
    enforcer.check_room("k1", None, "small")
    enforcer.release(held)
    for _ in range(2):
        enforcer.release(decide(enforcer, "k1", "big"))
    with pytest.raises(PolicyRejection) as refused:
        enforcer.check_room("k1", None, "big")
    assert refused.value.code == "rate_limit_exceeded"
    with pytest.raises(PolicyRejection) as refused:
        enforcer.check_room("nobody", None, "big")
    assert refused.value.status == 401


def test_each_model_gets_the_tier_of_its_own_load():
    enforcer = enforcer_for()
    enforcer.tiers.per_model = True  # several models (edge.app)
    enforcer.update_signals({"waiting_requests": 20.0}, "big")
    enforcer.update_signals({"waiting_requests": 0.0}, "small")
    enforcer.update_signals({"waiting_requests": 20.0})  # the box's view: the most loaded model's
    busy, calm = decide(enforcer, "k2", "big", max_tokens=16), decide(enforcer, "k2", "small", max_tokens=16)
    assert (busy.tier, busy.max_tokens, busy.notes) == ("busy", 8, ("max_tokens 16->8",))
    assert (calm.tier, calm.max_tokens, calm.notes) == ("normal", 16, ())
    assert not enforcer.speculation_allowed_for("big") and enforcer.speculation_allowed_for("small")
    assert enforcer.tier_state_of("big").name == "busy" and enforcer.evaluator.state.name == "busy"
    # a request predicted to miss its objective gets the tier one heavier than its model's
    assert enforcer.degrade_for_slo(calm).max_tokens == 8
    enforcer.tiers.keep({"small"})  # big unloaded: loaded again, it starts in normal operation
    assert enforcer.tier_state_of("big").name == "normal"
    enforcer.install(parse_policy(POLICY, "p.toml"))  # a reload keeps each model's tier
    enforcer.update_signals({"waiting_requests": 20.0}, "small")
    enforcer.install(parse_policy(POLICY, "p.toml"))
    assert enforcer.tier_state_of("small").name == "busy"


def test_one_model_the_box_tier_decides():
    enforcer = enforcer_for()  # tiers not per model: the single-model server's one evaluator
    enforcer.update_signals({"waiting_requests": 20.0}, "big")  # ignored: no per-model tiers
    assert decide(enforcer, "k2", "small").tier == "normal"
    enforcer.update_signals({"waiting_requests": 20.0})
    assert decide(enforcer, "k2", "small").tier == "busy" == enforcer.tier_state_of("small").name


def test_a_reload_may_not_drop_every_per_model_limit_silently():
    only_per_model = """
version = 1
[classes.team]
[classes.team.model_limits.big]
max_concurrent = 1
"""
    old, new = parse_policy(only_per_model, "old.toml"), parse_policy("version = 1\n", "new.toml")
    assert removed_protections(old, new) == ["rate_limits"]
    quota_only = parse_policy('version = 1\n[[keys]]\nkey = "k"\nclass = "default"\n'
                              'model_limits = { big = { tokens_per_month = 5 } }\n', "q.toml")
    assert "rate_limits" in removed_protections(quota_only, new)
