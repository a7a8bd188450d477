"""An accepted request as its handler sees it (`Run`), and what the gateway reads from its HTTP request: the API
key, the tenant, the route."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from contracts.messages import PromptLogprobs
from edge.api.openai_request import GenerateRequest
from edge.core.lifecycle import InFlight
from edge.core.request_record import RecordFacts
from policies.enforcer import Decision


@dataclass
class Run:
    """An accepted request as its handler sees it."""
    inflight: InFlight
    request: GenerateRequest  # with the policy's decisions applied to its sampling
    decision: Decision
    deadline: float
    key_id: str | None = None
    tenant: str | None = None
    client: str = ""
    route: str = ""  # the HTTP route it came in by (/v1/chat/completions, /v1/responses, ...)
    prompt_logprobs: PromptLogprobs | None = None  # the worker's scores of the prompt, when the request asked
    cached_tokens: int = 0  # prompt tokens its worker took from the prompt cache (PrefillDone), for usage

    @property
    def headers(self) -> dict[str, str]:
        """Tell the client what the policy did to its request."""
        headers = {"X-Request-Id": self.inflight.request_id, "X-Edge-Tier": self.decision.tier,
                   "X-Edge-Class": self.decision.client_class}
        if self.decision.notes:
            headers["X-Edge-Degraded"] = "; ".join(self.decision.notes)
        return headers

    @property
    def facts(self) -> RecordFacts:
        """Who asked for what, for the record of its ending."""
        return RecordFacts(self.key_id, self.decision.client_class, self.tenant, self.request.model,
                           self.request.kind, self.client, self.decision.notes, self.decision.tier,
                           self.request.user_text, self.route)


def bearer_key(request: web.Request) -> str | None:
    """The API key: 'Authorization: Bearer <key>', or Anthropic's 'x-api-key: <key>' (the same policy keys)."""
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key", "").strip() or None


def tenant_of(request: web.Request, policy) -> str | None:
    """The policy's tenant header's value, when it names one."""
    return request.headers.get(policy.tenant_header) if policy.tenant_header else None


def route_of(request: web.Request) -> str:
    """The route a request matched (its path pattern), for metrics and the audit log."""
    canonical = getattr(getattr(request.match_info.route, "resource", None), "canonical", None)
    return canonical if isinstance(canonical, str) else request.path[:200]
