"""Which models a key may use (issue 45): `models` on a class or a key (a key's list replaces its class's; empty:
every served model), with the filters' allowed_models over both; a model refused is a 404 model_not_found that names
only what the key may use."""

import pytest

from policies.enforcer import PolicyEnforcer, PolicyRejection, RequestFacts
from policies.loader import PolicyError, parse_policy

POLICY = """
version = 1
default_class = "open"
[filters]
allowed_models = ["a", "b", "c"]
[classes.open]
priority = 0
[classes.narrow]
priority = 5
models = ["a"]
[[keys]]
key = "k-open"
class = "open"
[[keys]]
key = "k-class"
class = "narrow"
[[keys]]
key = "k-own"
class = "narrow"
models = ["b", "c"]
"""
SERVED = {"a", "b", "c", "d"}


def decide(enforcer: PolicyEnforcer, key: str, model: str):
    return enforcer.decide(RequestFacts(key, None, model, "hi", 4, None, 1), SERVED)


def test_a_class_or_key_list_limits_the_models_and_the_filters_still_apply():
    enforcer = PolicyEnforcer(parse_policy(POLICY, "test.toml"), 16)
    assert enforcer.models_for("k-open", None, SERVED) == {"a", "b", "c"}  # d: not in allowed_models
    assert enforcer.models_for("k-class", None, SERVED) == {"a"}
    assert enforcer.models_for("k-own", None, SERVED) == {"b", "c"}  # the key's list replaces its class's
    assert enforcer.models_for("unknown", None, SERVED) == set()
    assert enforcer.priority_for("k-class", None) == 5 and enforcer.priority_for("unknown", None) == 0
    decide(enforcer, "k-own", "c")  # admitted
    with pytest.raises(PolicyRejection) as refused:
        decide(enforcer, "k-class", "b")
    assert refused.value.status == 404 and refused.value.code == "model_not_found"
    assert "available: ['a']" in refused.value.message  # no other model named


def test_models_must_be_a_list_of_names():
    with pytest.raises(PolicyError):
        parse_policy(POLICY.replace('models = ["a"]', 'models = "a"'), "test.toml")
    with pytest.raises(PolicyError):
        parse_policy(POLICY.replace('models = ["a"]', 'models = [""]'), "test.toml")
