"""Service-level objective keys: validated with file, line and key; hot-reloaded; a request's x-slo-ttft-ms header
tightens its class's objective within the class's bounds and never loosens it or changes its priority; the
"degrade" answer applies the next heavier tier; a tier may enter on SLO attainment."""

import os

import pytest

from policies.enforcer import PolicyEnforcer, PolicyRejection, RequestFacts
from policies.evaluator import TierEvaluator
from policies.loader import PolicyError, parse_policy
from policies.reloader import PolicyReloader

POLICY = """version = 1
default_class = "interactive"
[classes.interactive]
priority = 0
ttft_slo_ms = 1000
tpot_slo_ms = 150
on_slo_miss = "reject"
min_ttft_slo_ms = 200
[classes.batch]
priority = 10
[classes.chat]
priority = 0
ttft_slo_ms = 2000
on_slo_miss = "degrade"
degradable = ["cap_max_tokens"]
[[keys]]
key = "k-int"
class = "interactive"
[[keys]]
key = "k-batch"
class = "batch"
[[keys]]
key = "k-chat"
class = "chat"
[[tiers]]
name = "busy"
enter = { kv_cache_usage = 0.7 }
exit = { kv_cache_usage = 0.5 }
[tiers.actions]
cap_max_tokens = 64
logprobs = "strip"
[[tiers]]
name = "late"
enter = { slo_attainment_below = 0.9 }
exit = { slo_attainment_below = 0.95 }
[tiers.actions]
cap_max_tokens = 16
"""


def decide(enforcer, key="k-int", header=None, max_tokens=None):
    return enforcer.decide(RequestFacts(key, None, "m", "hello", max_tokens, None, 1, header), {"m"})


def refusal(enforcer, **kw) -> PolicyRejection:
    with pytest.raises(PolicyRejection) as info:
        decide(enforcer, **kw)
    return info.value


@pytest.fixture
def enforcer():
    return PolicyEnforcer(parse_policy(POLICY, "slo.toml"), default_max_tokens=100)


def test_the_keys_reach_the_class_and_the_decision(enforcer):
    cls = enforcer.policy.classes["interactive"]
    assert (cls.ttft_slo_ms, cls.tpot_slo_ms, cls.on_slo_miss, cls.min_ttft_slo_ms) == (1000, 150, "reject", 200)
    decision = decide(enforcer)
    assert (decision.ttft_slo_ms, decision.tpot_slo_ms, decision.on_slo_miss) == (1000, 150, "reject")
    batch = decide(enforcer, "k-batch")
    assert (batch.ttft_slo_ms, batch.tpot_slo_ms, batch.on_slo_miss) == (0, 0, "serve")


# (name, what replaces what, key path, line, words of the message)
INVALID = [
    ("negative objective", ("ttft_slo_ms = 1000", "ttft_slo_ms = -5"), "classes.interactive.ttft_slo_ms", 5,
     "expected a value >= 0"),
    ("objective as a string", ("tpot_slo_ms = 150", 'tpot_slo_ms = "150"'), "classes.interactive.tpot_slo_ms", 6,
     "expected an integer"),
    ("unknown answer", ('on_slo_miss = "reject"', 'on_slo_miss = "drop"'), "classes.interactive.on_slo_miss", 7,
     "expected one of ['reject', 'degrade', 'serve']"),
    ("floor looser than the objective", ("min_ttft_slo_ms = 200", "min_ttft_slo_ms = 5000"),
     "classes.interactive.min_ttft_slo_ms", 8, "looser than the class's ttft_slo_ms 1000"),
    ("reject without an objective", ("[classes.batch]\npriority = 10", '[classes.batch]\npriority = 10\n'
                                     'on_slo_miss = "reject"'), "classes.batch.on_slo_miss", 11, "needs a ttft_slo_ms"),
    ("misspelled key", ("tpot_slo_ms = 150", "tpot_slo = 150"), "classes.interactive.tpot_slo", 6, "unknown key"),
    ("attainment exit not above enter", ("exit = { slo_attainment_below = 0.95 }",
                                         "exit = { slo_attainment_below = 0.8 }"),
     "tiers[1].exit.slo_attainment_below", 35, "must be above the enter threshold"),
]


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_objective_keys_are_named_with_their_line(case):
    _, (old, new), key, line, words = case
    assert old in POLICY
    with pytest.raises(PolicyError) as info:
        parse_policy(POLICY.replace(old, new), "slo.toml")
    issue = next(i for i in info.value.issues if i.key == key)
    assert issue.line == line and words in issue.message, info.value


def test_degrade_needs_a_tier():
    text = POLICY[:POLICY.index("[[tiers]]")]
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "slo.toml")
    assert [i.key for i in info.value.issues] == ["classes.chat.on_slo_miss"] and "no [[tiers]]" in str(info.value)


def test_the_header_tightens_within_the_bounds(enforcer):
    assert decide(enforcer, header="500").ttft_slo_ms == 500
    assert decide(enforcer, header="200").ttft_slo_ms == 200  # the floor itself
    assert decide(enforcer, header="1000").ttft_slo_ms == 1000
    assert decide(enforcer, header="500").priority == 0  # asking for a tighter objective gains no priority


@pytest.mark.parametrize("header,key,words", [
    ("1500", "k-int", "would loosen class 'interactive''s objective of 1000 ms"),
    ("100", "k-int", "tighter than class 'interactive' allows (min_ttft_slo_ms 200)"),
    ("soon", "k-int", "positive whole number of milliseconds"),
    ("0", "k-int", "positive whole number"),
    ("500", "k-batch", "class 'batch' does not accept x-slo-ttft-ms"),
], ids=["loosen", "below the floor", "not a number", "zero", "class without a floor"])
def test_a_header_outside_the_bounds_is_a_400_naming_it(enforcer, header, key, words):
    err = refusal(enforcer, key=key, header=header)
    assert (err.status, err.code, err.param) == (400, "invalid_value", "x-slo-ttft-ms") and words in err.message
    assert sum(enforcer.active.values()) == 0  # nothing held for a refused request


def test_degrade_applies_the_next_heavier_tier_to_what_the_class_allows(enforcer):
    decision = decide(enforcer, "k-chat", max_tokens=100)
    degraded = enforcer.degrade_for_slo(decision)
    assert degraded.max_tokens == 64 and degraded.notes == ("max_tokens 100->64 (slo)",)
    assert degraded.ticket == decision.ticket  # the same concurrency slots, released once
    enforcer.update_signals({"kv_cache_usage": 0.8})  # "busy" in force: the next heavier is "late"
    busy = decide(enforcer, "k-chat", max_tokens=100)
    assert busy.max_tokens == 64 and enforcer.degrade_for_slo(busy).max_tokens == 16


def test_a_tier_enters_on_attainment_below_its_threshold_and_not_before_it_is_measured(enforcer):
    tiers = enforcer.policy.tiers
    evaluator = TierEvaluator(tiers)
    assert evaluator.update({"kv_cache_usage": 0.1}, 1.0) is None  # no attainment measured: nothing entered
    assert evaluator.update({"slo_attainment_below": 0.97}, 2.0) is None
    entered = evaluator.update({"slo_attainment_below": 0.85}, 3.0)
    assert entered.after == "late" and "slo_attainment_below=0.85 < 0.9" in entered.reason
    assert evaluator.update({"slo_attainment_below": 0.93}, 20.0) is None  # between the thresholds: stays
    assert evaluator.update({"slo_attainment_below": 0.96}, 21.0).after == "busy"


def test_objectives_are_hot_reloaded(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    enforcer = PolicyEnforcer(parse_policy(POLICY, str(path)))
    reloader = PolicyReloader(str(path), enforcer)
    path.write_text(POLICY.replace("ttft_slo_ms = 1000", "ttft_slo_ms = 800"))
    os.utime(path, ns=(1, 1))
    assert reloader.poll() is True and decide(enforcer).ttft_slo_ms == 800
    path.write_text(POLICY.replace("ttft_slo_ms = 1000", "ttft_slo_ms = -1"))
    os.utime(path, ns=(2, 2))
    assert reloader.poll() is False and "ttft_slo_ms" in reloader.last_error and decide(enforcer).ttft_slo_ms == 800


def test_the_shipped_objectives_preset_loads():
    from policies.loader import load_policy
    policy = load_policy("policies/presets/interactive-slo.toml")
    assert policy.classes["interactive"].ttft_slo_ms == 1000 and policy.classes["assist"].on_slo_miss == "degrade"
    assert policy.tiers[0].enter["slo_attainment_below"] == 0.9
