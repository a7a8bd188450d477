"""The limits a request counts against, and the refusals they give (policies.enforcer applies them): rate limits and
concurrency caps per key and per class, across models and on the request's model; token quotas per key, across
models and on its model (issue 45: a class's or key's `model_limits`)."""

from __future__ import annotations

from policies.quota import key_id
from policies.schema import ApiKeyRule, ClientClass, ModelLimits


class PolicyRejection(Exception):
    """A request the policy refuses; the gateway turns it into an OpenAI error."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: int | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.retry_after_s, self.param = retry_after_s, param


def request_limits(key_rule: ApiKeyRule | None, cls: ClientClass, model: str) -> list[tuple[str, int, int, str]]:
    """(slot, requests_per_minute, max_concurrent, model or "") of each limit a request of this key (or class) for
    this model counts against: the key's and the class's, across models ("key:K", "class:C") and on the model
    ("model:M/key:K", "model:M/class:C": a prefix no slot across models has, whatever the key or model is named)."""
    rules = [(f"key:{key_rule.key}", key_rule)] if key_rule is not None else []
    limits = []
    for slot, rule in [*rules, (f"class:{cls.name}", cls)]:
        limits.append((slot, rule.requests_per_minute, rule.max_concurrent, ""))
        own: ModelLimits | None = rule.model_limits.get(model)
        if own is not None and own.limits_requests:
            limits.append((f"model:{model}/{slot}", own.requests_per_minute, own.max_concurrent, model))
    return limits


def _holder(slot: str, model: str) -> str:
    """Who a slot counts for, as a refusal names it: "key" or "class"."""
    return (slot.removeprefix(f"model:{model}/") if model else slot).split(":")[0]


def model_counter(key_hash: str, model: str) -> str:
    """The quota counter of a key (by its hash) on one model: its hash, '@', the model's name."""
    return f"{key_hash}@{model}"


def quota_counters(rule: ApiKeyRule | None, model: str) -> list[tuple[str, int, int, str]]:
    """(counter, tokens_per_day, tokens_per_month, model or "") of each token quota a request of this key for this
    model counts against: the key's across models, and its own on the model."""
    if rule is None:
        return []
    counters = [(key_id(rule.key), rule.tokens_per_day, rule.tokens_per_month, "")]
    own = rule.model_limits.get(model)
    if own is not None and own.has_quota:
        counters.append((model_counter(key_id(rule.key), model), own.tokens_per_day, own.tokens_per_month, model))
    return [counter for counter in counters if counter[1] or counter[2]]


def on_model(model: str, words: str = " on model") -> str:
    return f"{words} {model!r}" if model else ""


def concurrency_refusal(slot: str, cap: int, model: str) -> PolicyRejection:
    return PolicyRejection(429, "concurrency_limit", f"{_holder(slot, model)} has {cap} requests in flight"
                           f"{on_model(model)}, its limit{' there' if model else ''}", 1, "model" if model else None)


def rate_refusal(slot: str, per_minute: int, model: str, wait: float) -> PolicyRejection:
    return PolicyRejection(429, "rate_limit_exceeded", f"rate limit of {per_minute} requests per minute"
                           f"{on_model(model)} reached for this {_holder(slot, model)}", max(1, round(wait)),
                           "model" if model else None)
