"""Hot reload of a policy file: on change (polled) or on demand (SIGHUP). A bad new file is refused
with its errors logged, and the policy in force stays."""

from __future__ import annotations

import logging
import os

from policies.enforcer import PolicyEnforcer
from policies.loader import PolicyError, load_policy

log = logging.getLogger("policies.reloader")


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
