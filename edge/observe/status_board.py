"""The operator's status page: a sampler keeping the last 15 minutes of load in a ring buffer, windows of finished
and refused requests heard from the gateway's observers, and the JSON the page (edge/http/static/status.html) polls.

The numbers come from where /metrics reads them (edge.observe.gauges): the engine's last stats, the prefill pool,
the in-flight registry (Gateway.load) and the tier evaluator. docs/status.md describes every field.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import secrets
import time
from importlib import resources

from aiohttp import web

from contracts.tasks import spawn
from edge.core.gateway import Gateway
from edge.core.request_record import RequestRecord

log = logging.getLogger("edge.observe.status_board")
WINDOW_S = 900.0  # what the charts and the per-class windows cover
INTERVAL_S = 1.0  # one sample per second: 900 samples
MAX_RECORDS = 5000  # per class, and of rejections: a flood keeps only its latest within the window
MAX_TRANSITIONS = 50
SAMPLE_FIELDS = ("t", "tier", "prefill_queue", "waiting", "running", "kv_used", "kv_total", "decode_tps",
                 "prefill_tps", "ttft_p95_s", "finished", "rejected")
SESSION_COOKIE = "edge_status_session"
SESSION_TTL_S = 8 * 3600.0  # a status session lasts a working day, then the operator signs in again
MAX_SESSIONS = 256  # the oldest dropped first


class StatusBoard:
    def __init__(self, gateway: Gateway, supervisor=None, reloader=None, clock=time.time, models=None) -> None:
        self.gateway, self.supervisor, self.reloader, self.clock = gateway, supervisor, reloader, clock
        self.models = models if models is not None and models.several else None  # [[models]]: the registry
        self.samples: collections.deque[tuple] = collections.deque(maxlen=int(WINDOW_S / INTERVAL_S))
        self.latency: dict[str, collections.deque] = {}  # class -> (time, ttft_s, tpot_s) of ended requests
        self.rejections: collections.deque[tuple[float, str]] = collections.deque(maxlen=MAX_RECORDS)
        # since start, as /metrics counts them: vllm:request_success by finished_reason, edge:requests_rejected
        self.finished: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        # the evaluator does not time its transitions: each is stamped when first seen here (within a second)
        self.transitions: collections.deque[dict] = collections.deque(maxlen=MAX_TRANSITIONS)
        self.transitions_seen = len(gateway.enforcer.evaluator.transitions)

    def observe(self, record: RequestRecord) -> None:
        """A Gateway observer: called once per request as it ends or is refused."""
        if record.status == "rejected":
            self.rejected[record.finish_reason] += 1
            self.rejections.append((record.time, record.finish_reason))
            return
        self.finished[record.finish_reason] += 1
        window = self.latency.setdefault(record.client_class, collections.deque(maxlen=MAX_RECORDS))
        window.append((record.time, record.ttft_s, record.tpot_s))

    async def running(self, app: web.Application):
        """aiohttp cleanup context: listen to the gateway and sample once a second while the app runs."""
        self.gateway.observers.append(self.observe)
        task = spawn(self._sample_forever(), "the status page sampler", log)
        yield
        task.cancel()
        self.gateway.observers.remove(self.observe)

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # one bad tick must not end the charts
                log.exception("status sample failed; the next one tries again")
            await asyncio.sleep(INTERVAL_S)

    def sample(self) -> None:
        gateway, stats = self.gateway, self.gateway.engine_stats
        waiting, used, total = gateway.load()
        self._stamp_transitions()
        self.samples.append((round(self.clock(), 2), gateway.enforcer.evaluator.state.index, gateway.pool.queue_length,
                             waiting, stats.num_running, used, total, round(stats.tokens_per_s, 1),
                             round(gateway.pool.tokens_per_s, 1), round(gateway.ttft_window.p95(), 4),
                             sum(self.finished.values()), sum(self.rejected.values())))

    def _stamp_transitions(self) -> None:
        transitions = self.gateway.enforcer.evaluator.transitions
        self.transitions_seen = min(self.transitions_seen, len(transitions))
        for t in transitions[self.transitions_seen:]:
            self.transitions.append({"time": self.clock(), "before": t.before, "after": t.after, "reason": t.reason})
        self.transitions_seen = len(transitions)

    def snapshot(self, since: float = 0.0) -> dict:
        """What the page shows now, and the samples taken after `since` (epoch seconds) for its charts."""
        gateway, stats, now = self.gateway, self.gateway.engine_stats, self.clock()
        waiting, used, total = gateway.load()
        self._stamp_transitions()
        return {
            "time": now, "model": gateway.model_name, "ready": gateway.ready, "shutting_down": gateway.shutting_down,
            "window_s": WINDOW_S, "tier": self._tier(), "transitions": list(self.transitions),
            "prefill": {"queue": gateway.pool.queue_length, "tokens_per_s": round(gateway.pool.tokens_per_s, 1),
                        "cache_tiers": self._cache_tiers(stats)},
            "decode": {"running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped,
                       "preemptions": stats.num_preemptions, "tokens_per_s": round(stats.tokens_per_s, 1),
                       "last_step_ms": round(stats.last_step_ms, 2)},
            "waiting": waiting,
            "kv": {"blocks_used": used, "blocks_total": total, "usage": round(used / total, 4) if total else 0.0,
                   "capacity_tokens": stats.kv_capacity_tokens},
            "requests": {"finished": sum(self.finished.values()), "finished_by_reason": dict(self.finished),
                         "rejected": sum(self.rejected.values())},
            "latency": self._latency(now),
            "slo": gateway.slo.attainment(),  # per class over 60 s: judged, attainment, goodput_rps (edge/core/slo.py)
            "rejections": {"recent": self._recent_rejections(now), "total": dict(self.rejected)},
            "processes": self._processes(),
            "models": self._models(),
            "sample_fields": SAMPLE_FIELDS, "samples": [s for s in self.samples if s[0] > since],
        }

    def _models(self) -> list[dict] | None:
        """With [[models]]: each model's state, memory (planned; measured while loaded) and load (with the degradation
        tier its own load puts its requests in); None otherwise."""
        if self.models is None:
            return None
        out = []
        for described in self.models.describe():
            stack = self.models.stack(described["name"])
            load = None
            if stack is not None:
                waiting, used, total = stack.gateway.load()
                load = {"waiting": waiting, "running": stack.gateway.engine_stats.num_running,
                        "kv_usage": round(used / total, 4) if total else 0.0,
                        "prefill_queue": stack.gateway.pool.queue_length,
                        "tier": self.gateway.enforcer.tier_state_of(described["name"]).name}  # its requests' tier
            out.append({key: described[key] for key in ("name", "state", "memory", "in_flight", "keep_alive",
                                                        "expires_at", "pinned", "error")} | {"load": load})
        return out

    def _cache_tiers(self, stats) -> dict:
        """The KV tiers' counts since start: each prompt cache tier summed over the workers (their heartbeats), and
        the engine's prefix blocks (hits and lookups in tokens)."""
        tiers: dict[str, dict] = {}
        for worker in self.gateway.pool.workers.values():
            for tier in worker.cache_tiers:
                into = tiers.setdefault(tier.name, dict.fromkeys(("hits", "misses", "entries", "bytes", "max_bytes",
                                                                  "evictions"), 0))
                for name in into:
                    into[name] += getattr(tier, name)
        tiers["engine_prefix"] = {"hits": stats.prefix_cache_hits,
                                  "misses": stats.prefix_cache_queries - stats.prefix_cache_hits}
        return tiers

    def _tier(self) -> dict:
        enforcer = self.gateway.enforcer
        state = enforcer.evaluator.state
        return {"name": state.name, "index": state.index, "reason": state.reason,
                "in_tier_s": round(enforcer.clock() - state.since, 1),
                "tiers": ["normal", *(t.name for t in enforcer.policy.tiers)], "source": enforcer.policy.source,
                "last_reload_error": self.reloader.last_error if self.reloader else None}

    def _latency(self, now: float) -> dict:
        """TTFT and TPOT percentiles per client class over the window; classes with no request in it drop out."""
        out = {}
        for name, window in list(self.latency.items()):
            _drop_older(window, now - WINDOW_S)
            if not window:
                del self.latency[name]
                continue
            ttft = sorted(r[1] for r in window if r[1] is not None)
            tpot = sorted(r[2] for r in window if r[2] is not None)
            out[name] = {"requests": len(window), "ttft_p50_s": _percentile(ttft, 0.5),
                         "ttft_p95_s": _percentile(ttft, 0.95), "tpot_p50_s": _percentile(tpot, 0.5),
                         "tpot_p95_s": _percentile(tpot, 0.95)}
        return out

    def _recent_rejections(self, now: float) -> dict:
        _drop_older(self.rejections, now - WINDOW_S)
        return dict(collections.Counter(reason for _, reason in self.rejections))

    def _processes(self) -> dict:
        """Each process: the supervisor's view (state, pid, restarts) and the gateway's connection to it."""
        gateway = self.gateway
        connections = {"decode_engine": gateway.engine}
        connections.update(gateway.pool.workers)
        launched = self.supervisor.snapshot() if self.supervisor else {}
        return {name: {**launched.get(name, {}), "connection": peer.state, "error": peer.last_error}
                for name, peer in connections.items()}


def _drop_older(window: collections.deque, cutoff: float) -> None:
    while window and window[0][0] < cutoff:
        window.popleft()


def _percentile(ordered: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    if not ordered:
        return None
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 4)


def page() -> str:
    """The page. It carries no key: its polls are let in by the session cookie it was served with."""
    return resources.files("edge.http").joinpath("static/status.html").read_text(encoding="utf-8")


LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>edge status: sign in</title></head>
<body><form method="post" action="/status/login">
<label>Admin API key <input type="password" name="key" autocomplete="current-password" autofocus></label>
<button type="submit">Sign in</button></form></body></html>
"""


class StatusSessions:
    """Sessions of the status page: an admin key proven once (a login POST, or basic auth / a bearer header on the
    page's load) gives a random token, sent back as an HttpOnly, SameSite=Strict cookie; the key itself never
    reaches the page. A session holds the key in the gateway's memory only, so that each use checks it against
    the policy in force (a key no longer admin loses its sessions), and ends after SESSION_TTL_S."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS, clock=time.monotonic) -> None:
        self.ttl_s, self.max_sessions, self._clock = ttl_s, max_sessions, clock
        self._sessions: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()

    def start(self, key: str) -> str:
        token = secrets.token_urlsafe(32)
        self._sessions[token] = (key, self._clock() + self.ttl_s)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return token

    def key(self, token: str | None) -> str | None:
        """The key a live session was opened with; None for no session, an unknown one or an expired one."""
        found = self._sessions.get(token or "")
        if found is None:
            return None
        if self._clock() >= found[1]:
            del self._sessions[token]
            return None
        return found[0]

    def end(self, token: str | None) -> None:
        self._sessions.pop(token or "", None)

    def set_cookie(self, response: web.StreamResponse, token: str, secure: bool) -> None:
        response.set_cookie(SESSION_COOKIE, token, max_age=int(self.ttl_s), path="/", httponly=True,
                            samesite="Strict", secure=secure)


SESSIONS = web.AppKey("status_sessions", StatusSessions)


STATUS = web.AppKey("status_board", StatusBoard)
