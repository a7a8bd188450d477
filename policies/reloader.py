"""Hot reload of a policy file: on change (polled) or on demand (SIGHUP). A bad new file is refused
with its errors logged, and the policy in force stays.

A reload is also refused when it would remove a protection entirely (every API key, every blocked word
and pattern, every rate or concurrency limit or token quota, per model too) and the new file does not say so in
allow_weaker_protection: an empty or truncated file saved by mistake must not open the service up."""

from __future__ import annotations

import logging
import os

from policies.enforcer import PolicyEnforcer
from policies.loader import PolicyError, load_policy
from policies.schema import PROTECTIONS, Policy
from policies.validation import Issue

log = logging.getLogger("policies.reloader")

_IN_FORCE = {
    "keys": lambda policy: bool(policy.keys),
    "blocked_content": lambda policy: bool(policy.filters.blocked_words or policy.filters.blocked_patterns),
    "rate_limits": lambda policy: _limits_in_force(policy),
    "prefix_cache_isolation": lambda policy: policy.prefix_cache_scope != "shared",
}


def _limits_in_force(policy: Policy) -> bool:
    keys = policy.keys.values()
    rules = (*policy.classes.values(), *keys)
    return (any(rule.requests_per_minute or rule.max_concurrent for rule in rules)
            or any(rule.tokens_per_day or rule.tokens_per_month for rule in keys)
            or any(own.limits_requests or own.has_quota for rule in rules for own in rule.model_limits.values()))


def removed_protections(old: Policy, new: Policy) -> list[str]:
    """The protections in force under old that new would remove entirely and does not allow to."""
    return [name for name, in_force in _IN_FORCE.items()
            if in_force(old) and not in_force(new) and name not in new.allow_weaker_protection]


def refusal(removed: list[str]) -> Issue:
    what = "; ".join(PROTECTIONS[name] for name in removed)
    allow = ", ".join(f'"{name}"' for name in removed)
    return Issue("allow_weaker_protection", f"this file would remove {what}; the policy in force keeps them. "
                 f"If that is intended, add allow_weaker_protection = [{allow}] to the file")


class PolicyReloader:
    def __init__(self, path: str, enforcer: PolicyEnforcer) -> None:
        self.path = path
        self.enforcer = enforcer
        self.mtime = self._mtime()
        self.reloads = 0
        self.failures = 0
        self.last_error: str | None = None

    def _mtime(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def poll(self) -> bool | None:
        """Reload if the file changed since the last look; None when unchanged."""
        mtime = self._mtime()
        if mtime == self.mtime:
            return None
        self.mtime = mtime
        return self.reload()

    def reload(self) -> bool:
        try:
            policy = load_policy(self.path)
            if removed := removed_protections(self.enforcer.policy, policy):
                raise PolicyError(self.path, [refusal(removed)])
        except PolicyError as err:
            self.failures += 1
            self.last_error = str(err)
            log.error("policy %s refused, the previous policy stays in force:\n%s", self.path, err)
            return False
        self.enforcer.install(policy)
        self.reloads += 1
        self.last_error = None
        log.info("policy %s loaded: %d classes, %d keys, %d tiers", self.path, len(policy.classes),
                 len(policy.keys), len(policy.tiers))
        return True
