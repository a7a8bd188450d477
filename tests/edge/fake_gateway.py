"""A real edge.core.gateway.Gateway on fakes, for the HTTP tests: a fake engine link (fake_engine_link.FakeEngine) and
a pool with no worker ready, so nothing is admitted (a request that passes its checks is answered 503); the
refusals its observers hear are kept as (HTTP status, code)."""

from __future__ import annotations

from types import SimpleNamespace

from fake_engine_link import FakeEngine

from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from policies.enforcer import PolicyEnforcer
from policies.schema import ApiKeyRule, Policy

VOCAB = 49152  # what the embedded model's workers report at their handshake


def fake_gateway(policy: Policy | None = None) -> tuple[Gateway, list[tuple[int, str]]]:
    pool = SimpleNamespace(vocab_size=VOCAB, queue_length=0, tokens_per_s=0.0, workers={}, num_ready=0,
                           embedding=None)
    gateway = Gateway(ServeConfig(), "m", pool, FakeEngine(), InFlightRegistry(), Metrics("m"),
                      PolicyEnforcer(policy or Policy("test")))
    refusals: list[tuple[int, str]] = []
    gateway.observers.append(lambda record: refusals.append((record.http_status, record.finish_reason))
                             if record.status == "rejected" else None)
    return gateway, refusals


def keyed(keys: dict[str, bool]) -> Policy:
    """A policy whose API keys are these (key -> may see the status page)."""
    return Policy("test", keys={key: ApiKeyRule(key, "default", admin=admin) for key, admin in keys.items()})


def rejected_count(gateway: Gateway, reason: str) -> float:
    """edge:requests_rejected for the reason, as /metrics shows it."""
    for line in gateway.metrics.render().decode().splitlines():
        if line.startswith("edge:requests_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
