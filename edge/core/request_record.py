"""How one request ended, as the gateway tells its observers (audit log, status page, tracing)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from edge.api.openai_request import ApiError
from edge.core.lifecycle import InFlight, RequestStatus


@dataclass(frozen=True)
class RequestRecord:
    """How one request ended, for the gateway's observers (audit log, status page). It never holds the API key
    (key_id is a hash of it); prompt_text is the client's text, for an observer to hash or, if told to, keep."""
    time: float  # wall clock (epoch seconds) at the end
    request_id: str  # "" for a request refused before it got one
    key_id: str | None  # "sha256:<16 hex>" of the bearer token; None without one
    client_class: str  # "" when refused before the policy chose one
    tenant: str | None
    model: str
    kind: str  # "chat" or "completion"
    client: str  # the peer's address
    status: str  # "finished", "aborted", "failed" or "rejected"
    finish_reason: str  # "stop", "length", "abort", "error", or the error code of a refusal
    http_status: int  # 200 for a finished request, else the status answered (0: the client went away)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    degradation: tuple[str, ...] = ()  # what the degradation tier changed
    tier: str = ""
    priority: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None  # mean time per output token after the first
    e2e_s: float | None = None
    prompt_text: str = ""
    # wall-clock times (epoch seconds) of the request's phases that happened: created, prefill_started (the
    # last dispatch to a worker), handed_off, first_token; the end is `time`
    marks: tuple[tuple[str, float], ...] = ()
    route: str = ""  # the HTTP route (/v1/chat/completions, /v1/responses, /v1/messages, ...)


@dataclass(frozen=True)
class RecordFacts:
    """Who asked for what: the part of an accepted request's record known when it was admitted."""
    key_id: str | None
    client_class: str
    tenant: str | None
    model: str
    kind: str
    client: str
    degradation: tuple[str, ...]
    tier: str
    prompt_text: str
    route: str


def ended_record(inflight: InFlight, facts: RecordFacts, status: RequestStatus, reason: str, usage: dict,
                 error: ApiError | None) -> RequestRecord:
    """The record of an accepted request that has just reached its terminal `status`."""
    now = time.perf_counter()
    completion = usage.get("completion_tokens", 0)
    ttft = inflight.first_token_at - inflight.created if inflight.first_token_at is not None else None
    tpot = None
    if completion > 1 and inflight.first_token_at is not None and inflight.last_token_at is not None:
        tpot = (inflight.last_token_at - inflight.first_token_at) / (completion - 1)
    http_status = 200 if status is RequestStatus.FINISHED else error.status if error is not None else 0
    wall = time.time()
    marks = tuple((name, wall - (now - at)) for name, at in (
        ("created", inflight.created), ("prefill_started", inflight.prefill_started_at),
        ("handed_off", inflight.handed_off_at), ("first_token", inflight.first_token_at)) if at is not None)
    return RequestRecord(wall, inflight.request_id, facts.key_id, facts.client_class, facts.tenant, facts.model,
                         facts.kind, facts.client, status.name.lower(), reason, http_status,
                         max(usage.get("prompt_tokens", 0), inflight.num_prompt_tokens), completion,
                         facts.degradation, facts.tier, inflight.priority, ttft, tpot, now - inflight.created,
                         facts.prompt_text, marks, facts.route)
