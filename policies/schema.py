"""The policy file's data model (frozen dataclasses): filters, client classes, degradation tiers.

See docs/policies.md for the TOML form of each field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# load signals a tier condition may name, and what each measures
SIGNALS = {
    "kv_cache_usage": "fraction of decode KV blocks in use, 0-1",
    "waiting_requests": "requests waiting for prefill or decode admission",
    "prefill_queue": "prompts waiting for a prefill worker",
    "cpu_percent": "CPU utilization of the box, 0-100 (psutil)",
    "memory_percent": "memory in use on the box, 0-100 (psutil)",
    "ttft_p95_s": "95th percentile time to first token over the last 30 s",
    # the one signal that enters when it falls BELOW its threshold (and leaves when it is back at or above the exit)
    "slo_attainment_below": "the lowest share of any class's requests meeting their objectives over the last 60 s, "
                            "0-1 (absent until 5 requests of a class with objectives were judged)",
}
BELOW_SIGNALS = ("slo_attainment_below",)  # signals whose tier conditions compare the other way
ACTIONS = ("cap_max_tokens", "logprobs", "max_prompt_tokens", "shed", "kv_type")
# protections a reload may not remove entirely unless the new file names them in allow_weaker_protection
PROTECTIONS = {
    "keys": "every API key (authentication would be off)",
    "blocked_content": "every blocked word and pattern",
    "rate_limits": "every requests_per_minute and max_concurrent limit (of classes and keys, and per model) and "
                   "token quota",
    "prefix_cache_isolation": "the prompt caches' separation by API key (prefix_cache.scope would be \"shared\")",
}


@dataclass(frozen=True)
class Filters:
    max_prompt_tokens: int = 2048
    max_output_tokens: int = 2048
    allowed_models: tuple[str, ...] = ()  # empty: every served model
    blocked_words: tuple[str, ...] = ()
    blocked_patterns: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelLimits:
    """The limits of a key or class on one model (issue 45), on top of its limits across models. On a class they
    count every request of the class for that model together; on a key, that key's own."""
    requests_per_minute: int = 0  # 0: unlimited
    max_concurrent: int = 0  # 0: unlimited
    tokens_per_day: int = 0  # prompt + completion tokens of that model per UTC day (keys only); 0: unlimited
    tokens_per_month: int = 0  # ... per UTC calendar month (keys only)

    @property
    def has_quota(self) -> bool:
        return bool(self.tokens_per_day or self.tokens_per_month)

    @property
    def limits_requests(self) -> bool:
        return bool(self.requests_per_minute or self.max_concurrent)


@dataclass(frozen=True)
class ClientClass:
    name: str
    priority: int = 0  # lower runs earlier
    requests_per_minute: int = 0  # 0: unlimited
    max_concurrent: int = 0  # 0: unlimited
    max_output_tokens: int = 0  # 0: the filters' limit
    degradable: tuple[str, ...] = ACTIONS  # which tier actions may touch this class
    ttft_slo_ms: int = 0  # time-to-first-token objective; 0: none (policies/slo.py)
    tpot_slo_ms: int = 0  # time-per-output-token objective after the first; 0: none
    on_slo_miss: str = "serve"  # reject | degrade | serve: a request predicted to miss its TTFT objective
    min_ttft_slo_ms: int = 0  # the tightest TTFT objective the x-slo-ttft-ms header may ask for; 0: not accepted
    models: tuple[str, ...] = ()  # the models its requests may use; empty: every served one (issue 45)
    model_limits: dict[str, ModelLimits] = field(default_factory=dict)  # model -> its requests' limits on it


@dataclass(frozen=True)
class ApiKeyRule:
    key: str
    client_class: str
    requests_per_minute: int = 0
    max_concurrent: int = 0
    tokens_per_day: int = 0  # prompt + completion tokens per UTC day; 0: unlimited
    tokens_per_month: int = 0  # ... per UTC calendar month
    id: str = ""  # the name logs show instead of the key's hash; "": the hash
    admin: bool = False  # may see the operator's status page
    models: tuple[str, ...] = ()  # the models this key may use (replacing its class's); empty: its class's (issue 45)
    model_limits: dict[str, ModelLimits] = field(default_factory=dict)  # model -> this key's limits and quotas on it


@dataclass(frozen=True)
class AuditRules:
    log_text: bool = False  # the audit log keeps the prompt text itself, not only its hash


@dataclass(frozen=True)
class TierActions:
    cap_max_tokens: int = 0  # 0: no cap
    logprobs: str = "allow"  # allow | strip | refuse
    max_prompt_tokens: int = 0  # 0: the filters' limit
    shed_classes: tuple[str, ...] = ()  # answered 429 with Retry-After
    retry_after_s: int = 5
    kv_type: str = ""  # "" keeps the configured KV type; "q4_0" halves KV handoff size again
    speculative: bool = True  # False: no speculative decoding while the tier holds (engine-wide: drafts cost batch
    # compute, which a loaded engine needs for its batch); not a per-class action


@dataclass(frozen=True)
class Tier:
    name: str
    enter: dict[str, float]  # enter when ANY signal >= its threshold
    exit: dict[str, float]  # leave when ALL of these signals < their threshold (and dwell has passed)
    min_dwell_s: float = 10.0
    actions: TierActions = field(default_factory=TierActions)


@dataclass(frozen=True)
class Policy:
    source: str  # file path, or "<built-in>"
    filters: Filters = field(default_factory=Filters)
    classes: dict[str, ClientClass] = field(default_factory=lambda: {"default": ClientClass("default")})
    default_class: str = "default"
    keys: dict[str, ApiKeyRule] = field(default_factory=dict)  # api key -> rule; empty: no auth
    tenant_header: str = ""  # e.g. "X-Tenant": its value picks a class through tenant_classes
    tenant_classes: dict[str, str] = field(default_factory=dict)
    tiers: tuple[Tier, ...] = ()  # in order of severity: later tiers are heavier
    allow_weaker_protection: tuple[str, ...] = ()  # PROTECTIONS this file may remove on reload
    audit: AuditRules = field(default_factory=AuditRules)
    # who may reuse whose cached prompts (edge.core.cache_salt): "key", per API key (per tenant header without keys);
    # "shared", everyone's, which lets one client time another's prompts: an explicit choice
    prefix_cache_scope: str = "key"
    # API key -> the group of keys that share one prompt cache (prefix_cache.groups): sharing named, not implied
    prefix_cache_groups: dict[str, str] = field(default_factory=dict)
