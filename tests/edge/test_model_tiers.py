"""Degradation tiers per model (issue 45): with several models, the front gateway's policy tick (edge.app) feeds each
loaded model's evaluator that model's own load, so a busy model's requests are degraded and another model's are
not; the box's tier (the status page's) is the most loaded model's; speculation follows each engine's own tier."""

from types import SimpleNamespace

from fake_engine_link import FakeEngine

from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from policies.enforcer import PolicyEnforcer, RequestFacts
from policies.loader import parse_policy

POLICY = """
version = 1
[[tiers]]
name = "busy"
enter = { prefill_queue = 10 }
exit = { prefill_queue = 5 }
min_dwell_s = 0
[tiers.actions]
cap_max_tokens = 8
speculative = false
"""


def gateway(name: str, enforcer: PolicyEnforcer) -> Gateway:
    pool = SimpleNamespace(queue_length=0, tokens_per_s=0.0, workers={}, num_ready=0, embedding=None)
    return Gateway(ServeConfig(), name, pool, FakeEngine(), InFlightRegistry(), Metrics(name), enforcer)


def test_each_model_is_degraded_by_its_own_load_not_the_others():
    enforcer = PolicyEnforcer(parse_policy(POLICY, "p.toml"))
    enforcer.tiers.per_model = True  # what edge.app sets with [[models]]
    front, a, b = gateway("", enforcer), gateway("a", enforcer), gateway("b", enforcer)
    a.pool.queue_length = 20  # a's prompts pile up; b is idle
    front.update_policy_signals((a, b))

    def tier_of(model: str) -> str:
        return enforcer.decide(RequestFacts(None, None, model, "hi", 16, None), {"a", "b"}).tier
    assert (tier_of("a"), tier_of("b")) == ("busy", "normal")
    assert enforcer.evaluator.state.name == "busy"  # the box's: the most loaded model's
    assert (a.engine.speculation, b.engine.speculation) == (False, True)  # each engine by its own tier
    transitions = a.metrics.render().decode()
    assert 'edge:degradation_tier_transitions_total{after="busy",before="normal",model_name="a"} 1.0' in transitions
    assert "degradation_tier_transitions_total{" not in b.metrics.render().decode()
    a.pool.queue_length, b.pool.queue_length = 0, 30  # the load moves to b
    front.update_policy_signals((a, b))
    assert (tier_of("a"), tier_of("b")) == ("normal", "busy")
    assert (a.engine.speculation, b.engine.speculation) == (True, False)
    front.update_policy_signals((a,))  # b unloaded: its evaluator is forgotten, the box follows a
    assert set(enforcer.tiers.evaluators) == {"", "a"} and enforcer.evaluator.state.name == "normal"


def test_one_model_its_gateway_feeds_the_box_tier_as_before():
    enforcer = PolicyEnforcer(parse_policy(POLICY, "p.toml"))
    only = gateway("m", enforcer)
    only.pool.queue_length = 20
    only.update_policy_signals()
    decision = enforcer.decide(RequestFacts(None, None, "m", "hi", 16, None), {"m"})
    assert (decision.tier, decision.max_tokens) == ("busy", 8) and not only.engine.speculation
    assert enforcer.tier_state_of("m").name == "busy" and set(enforcer.tiers.evaluators) == {""}
