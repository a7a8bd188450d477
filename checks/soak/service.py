"""The service under soak: its config and policy, and how the soak's threads read it (a clock from the end of
the warm-up, /health and /metrics that never raise)."""

from __future__ import annotations

import time

import httpx

from server_process import ServerProcess, wait_for

MODEL = "SmolLM2-135M-Instruct.Q4_1"
KEYS = {"interactive": "soak-interactive", "standard": "soak-standard", "batch": "soak-batch"}
REQUEST_TIMEOUT_S = 60
CLIENT_DEADLINE_S = REQUEST_TIMEOUT_S + 10  # a request still unanswered by then hung
SETTLE_BOUND_S = 60.0
CONFIG = f"""
prefill_workers = 2
kv_cache_tokens = 8192
max_model_len = 1200
worker_heartbeat_timeout_s = 3
[limits]
prefill_queue_size = 16
request_timeout_s = {REQUEST_TIMEOUT_S}
shutdown_grace_s = 1
"""
POLICY = """
version = 1
default_class = "standard"
[filters]
max_prompt_tokens = 1024
max_output_tokens = 256
blocked_words = ["forbidden", "secret plan"]
[classes.interactive]
priority = 0
[classes.standard]
priority = 5
[classes.batch]
priority = 10
max_concurrent = 2
""" + "".join(f'[[keys]]\nkey = "{key}"\nclass = "{name}"\n' for name, key in KEYS.items())


class Service:
    """One started service as the soak sees it; t0 is reset when the warm-up ends."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def health(self) -> dict | None:
        try:
            return self.server.health()
        except (httpx.HTTPError, ValueError):
            return None

    def pid_of(self, name: str) -> int | None:
        health = self.health() or {}
        return health.get("processes", {}).get(name, {}).get("pid")

    def metric(self, name: str) -> float:
        try:
            return self.server.metric(name)
        except (httpx.HTTPError, KeyError, ValueError):
            return 0.0


def settle(server: ServerProcess) -> tuple[float | None, dict]:
    """Seconds until /health is ok and the engine is idle with no KV blocks held (None: not within the bound)."""
    names = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "kv_blocks_used": "edge:kv_cache_blocks_used"}
    seen: dict = {}

    def idle() -> bool:
        try:
            seen.update({k: server.metric(v) for k, v in names.items()}, status=server.health()["status"])
        except (httpx.HTTPError, KeyError, ValueError):
            return False
        return seen["status"] == "ok" and not any(seen[k] for k in names)
    started = time.monotonic()
    return (time.monotonic() - started if wait_for(idle, SETTLE_BOUND_S, 0.5) else None), seen
