"""Apply a policy to one request before any model work: who is asking (class), what they may ask for,
and what the degradation tier in force changes about it."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass

from policies.content_filter import ContentFilter
from policies.evaluator import NORMAL, ModelTiers, TierEvaluator, Transition
from policies.limits import (
    PolicyRejection,
    concurrency_refusal,
    model_counter,
    on_model,
    quota_counters,
    rate_refusal,
    request_limits,
)
from policies.quota import TokenQuotas, key_id
from policies.rate_limit import RateLimiter
from policies.schema import ApiKeyRule, ClientClass, Policy, Tier
from policies.slo import HEADER, ObjectiveError, request_ttft_objective


@dataclass(frozen=True)
class RequestFacts:
    api_key: str | None  # the bearer token, None when absent
    tenant: str | None  # value of the policy's tenant header, if any
    model: str
    text: str  # all client-supplied text, for content rules
    max_tokens: int | None  # None: not given
    logprobs: int | None
    n: int = 1  # choices: the output limits count n x max_tokens
    slo_ttft_ms: str | None = None  # the x-slo-ttft-ms header as sent: a tighter TTFT objective (policies/slo.py)


@dataclass(frozen=True)
class Decision:
    client_class: str
    priority: int
    max_tokens: int
    logprobs: int | None
    max_prompt_tokens: int
    kv_type: str  # "" keeps the configured KV type
    tier: str  # the degradation tier in force for its model
    notes: tuple[str, ...]  # what degradation changed, for the client's X-Edge-Degraded header
    ticket: tuple[str, ...]  # the concurrency slots it holds until released (key, class, and theirs on its model)
    quota_holds: tuple[tuple[str, int], ...] = ()  # (quota counter, tokens) held from its key's quotas until released
    ttft_slo_ms: int = 0  # this request's TTFT objective (the class's, or tighter by header); 0: none
    tpot_slo_ms: int = 0  # its class's TPOT objective; 0: none
    on_slo_miss: str = "serve"  # reject | degrade | serve, when its TTFT objective is predicted to be missed


class PolicyEnforcer:
    def __init__(self, policy: Policy, default_max_tokens: int = 256, clock=time.monotonic,
                 quotas: TokenQuotas | None = None) -> None:
        self.clock = clock
        self.default_max_tokens = default_max_tokens
        self.rate_limiter = RateLimiter(clock)
        self.quotas = quotas or TokenQuotas()  # outlives any one policy: a reload keeps the counts
        self.active: Counter = Counter()  # concurrency per slot of policies.limits.request_limits
        # the box's tier evaluator and, with several models (edge.app sets tiers.per_model), each model's own
        self.tiers = ModelTiers((), clock())
        self.install(policy)

    def install(self, policy: Policy) -> None:
        """Switch to a new policy (hot reload); the tier in force is kept when the new policy still has it."""
        self.policy = policy
        self.rules_by_key_id = {key_id(rule.key): rule for rule in policy.keys.values()}  # for observers' records
        self.content_filter = ContentFilter(policy.filters.blocked_words, policy.filters.blocked_patterns)
        self.tiers.reinstall(policy.tiers, self.clock())

    @property
    def evaluator(self) -> TierEvaluator:
        """The box's tier evaluator (with several models, fed the most loaded model's signals)."""
        return self.tiers.box

    def tier_state_of(self, model: str):
        """The tier in force for requests for `model` (edge.observe: each model's status and gauge)."""
        return self.tiers.of(model, self.clock()).state

    def update_signals(self, signals: dict[str, float], model: str = "") -> Transition | None:
        """The latest load signals: the box's (model ""), or one model's, whose requests its tier then decides."""
        return self.tiers.update(signals, model, self.clock())

    @property
    def speculation_allowed(self) -> bool:
        """False while the box's tier in force turns speculative decoding off."""
        return self.speculation_allowed_for("")

    def speculation_allowed_for(self, model: str) -> bool:
        """False while the tier in force for `model` (its engine's) turns speculative decoding off."""
        index = self.tiers.of(model, self.clock()).state.index
        return index < 0 or self.policy.tiers[index].actions.speculative

    @property
    def auth_required(self) -> bool:
        return bool(self.policy.keys)

    def decide(self, facts: RequestFacts, served_models: set[str]) -> Decision:
        filters = self.policy.filters
        key_rule = self._authenticate(facts.api_key)
        self._check_quota(key_rule, facts.model)
        cls = self._class_for(key_rule, facts.tenant)
        if not self.model_allowed(key_rule, cls, facts.model, served_models):
            allowed = sorted(m for m in served_models if self.model_allowed(key_rule, cls, m, served_models))
            raise PolicyRejection(404, "model_not_found", f"model {facts.model!r} is not available; available: "
                                  f"{allowed}", param="model")
        if self.content_filter.check(facts.text) is not None:
            raise PolicyRejection(403, "content_blocked", "the request contains blocked content")
        output_limit = min(filters.max_output_tokens, cls.max_output_tokens or filters.max_output_tokens)
        n = facts.n
        requested = (facts.max_tokens if facts.max_tokens is not None
                     else max(1, min(self.default_max_tokens, output_limit // n)))
        if requested * n > output_limit:
            got = f"{requested}" if n == 1 else f"{requested} for each of n = {n} choices ({requested * n} in all)"
            raise PolicyRejection(400, "invalid_value", f"'max_tokens' must be at most {output_limit} for class "
                                  f"{cls.name!r}{'' if n == 1 else ', counting every choice'}, got {got}",
                                  param="max_tokens")
        try:
            ttft_slo_ms = request_ttft_objective(cls.name, cls.ttft_slo_ms, cls.min_ttft_slo_ms, facts.slo_ttft_ms)
        except ObjectiveError as err:
            raise PolicyRejection(400, "invalid_value", str(err), param=HEADER) from None
        tier = self.tiers.of(facts.model, self.clock()).tier  # its model's (with several models)
        decision = self._degrade(cls, requested, facts.logprobs, filters.max_prompt_tokens, n, tier)
        decision = dataclasses.replace(decision, ticket=self._admit(key_rule, cls, facts.model),
                                       ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=cls.tpot_slo_ms,
                                       on_slo_miss=cls.on_slo_miss)
        try:
            return self._hold_quota(key_rule, decision, facts)
        except PolicyRejection:
            self.release(decision)
            raise

    def release(self, decision: Decision) -> None:
        for slot in decision.ticket:
            if slot and self.active[slot] > 0:
                self.active[slot] -= 1
        for counter, tokens in decision.quota_holds:
            self.quotas.unhold(counter, tokens)

    def _hold_quota(self, rule: ApiKeyRule | None, decision: Decision, facts: RequestFacts) -> Decision:
        """Hold what the request may use from its key's quotas (across models and on its model) until it ends: its
        prompt, estimated at 4 bytes a token (the end counts the real number), and n x max_tokens. A max_tokens the
        client left out is lowered to what is left; one it asked for that does not fit is a 429 saying how much is
        left, of which quota."""
        counters = quota_counters(rule, facts.model)
        states = [(q, model) for counter, day, month, model in counters
                  if (q := self.quotas.tightest(counter, day, month)) is not None]
        if not states:
            return decision
        tightest, model = min(states, key=lambda state: state[0].limit - state[0].used)
        prompt = min(decision.max_prompt_tokens, len(facts.text.encode("utf-8", "surrogatepass")) // 4)
        left, n, max_tokens, notes = tightest.limit - tightest.used - prompt, facts.n, decision.max_tokens, ()
        if n * max_tokens > left:
            if facts.max_tokens is not None or left < n:
                who = f"key {rule.id!r}" if rule.id else "this key"
                raise PolicyRejection(429, "quota_exceeded", f"this request may use {prompt + n * max_tokens} tokens "
                                      f"(its prompt and n x max_tokens); {who} has {max(0, left + prompt)} left of "
                                      f"its {tightest.quota} quota of {tightest.limit}{on_model(model)} until "
                                      f"{tightest.resets_at:%Y-%m-%dT%H:%M:%SZ}: ask for fewer tokens",
                                      tightest.retry_after_s, "max_tokens")
            notes, max_tokens = (f"max_tokens {max_tokens}->{left // n} (quota)",), left // n
        holds = tuple((counter, prompt + n * max_tokens) for counter, day, month, _ in counters if day or month)
        for counter, tokens in holds:
            self.quotas.hold(counter, tokens)
        return dataclasses.replace(decision, max_tokens=max_tokens, notes=decision.notes + notes, quota_holds=holds)

    def model_allowed(self, key_rule: ApiKeyRule | None, cls: ClientClass, model: str, served: set[str]) -> bool:
        """Served here, and admitted by the filters' allowed_models, the key's models (when it names any, else its
        class's) (issue 45). A model refused here is answered as one that does not exist (404, no existence leak)."""
        allowed = self.policy.filters.allowed_models
        own = key_rule.models if key_rule is not None and key_rule.models else cls.models
        return model in served and (not allowed or model in allowed) and (not own or model in own)

    def models_for(self, api_key: str | None, tenant: str | None, served: set[str]) -> set[str]:
        """The served models this key (or tenant) may use; none for a key the policy does not know."""
        try:
            key_rule = self._authenticate(api_key)
        except PolicyRejection:
            return set()
        cls = self._class_for(key_rule, tenant)
        return {m for m in served if self.model_allowed(key_rule, cls, m, served)}

    def priority_for(self, api_key: str | None, tenant: str | None) -> int:
        """The priority of this key's (or tenant's) class, for ordering before its request is decided; 0 unknown."""
        try:
            return self._class_for(self._authenticate(api_key), tenant).priority
        except (PolicyRejection, KeyError):
            return 0

    def _authenticate(self, api_key: str | None) -> ApiKeyRule | None:
        if not self.policy.keys:
            return None
        rule = self.policy.keys.get(api_key or "")
        if rule is None:
            raise PolicyRejection(401, "invalid_api_key",
                                  "missing or wrong API key (send 'Authorization: Bearer <key>')")
        return rule

    def _check_quota(self, rule: ApiKeyRule | None, model: str) -> None:
        """A 429 when a quota of the key is used up: across models, or on this model (issue 45)."""
        for counter, per_day, per_month, on in quota_counters(rule, model):
            if over := self.quotas.exceeded(counter, per_day, per_month):
                who = f"key {rule.id!r}" if rule.id else "this key"
                when = "UTC midnight" if over.quota == "tokens_per_day" else "the first of the month, UTC"
                used = f"{over.used} tokens{on_model(on, ' of model')}"
                raise PolicyRejection(429, "quota_exceeded", f"{who} has used {used}, its {over.quota} quota"
                                      f"{' for that model' if on else ''} is {over.limit}; it resets at "
                                      f"{over.resets_at:%Y-%m-%dT%H:%M:%SZ} ({when})", over.retry_after_s,
                                      "model" if on else None)

    def check_room(self, api_key: str | None, tenant: str | None, model: str) -> None:
        """Whether a request of this key for this model would be refused by a limit now (a concurrency cap reached,
        a rate bucket empty, a quota used up), raising that PolicyRejection; takes nothing. Asked before a model is
        loaded for a request, so that a refused client cannot make a model load (and another be evicted)."""
        key_rule = self._authenticate(api_key)
        self._check_quota(key_rule, model)
        for slot, per_minute, cap, on in request_limits(key_rule, self._class_for(key_rule, tenant), model):
            if cap and self.active[slot] >= cap:
                raise concurrency_refusal(slot, cap, on)
            if wait := self.rate_limiter.wait(slot, per_minute):
                raise rate_refusal(slot, per_minute, on, wait)

    def count_tokens(self, record) -> None:
        """A request observer (takes edge.core.request_record.RequestRecord): an ended request's prompt + completion
        tokens count against its key's quotas, and its key's on its model (counted for every model, so a per-model
        quota added by a reload sees the day's use). Only the policy's keys are counted, so made-up keys sent to a
        server without authentication cannot grow the counts."""
        tokens = record.prompt_tokens + record.completion_tokens
        if tokens and record.key_id in self.rules_by_key_id:
            self.quotas.add(record.key_id, tokens)
            if record.model:
                self.quotas.add(model_counter(record.key_id, record.model), tokens)

    def key_name(self, key_hash: str | None) -> str | None:
        """What logs call a key: its rule's id when the policy gives one, else its hash."""
        rule = self.rules_by_key_id.get(key_hash)
        return rule.id if rule is not None and rule.id else key_hash

    def _class_for(self, key_rule: ApiKeyRule | None, tenant: str | None) -> ClientClass:
        policy = self.policy
        name = key_rule.client_class if key_rule else policy.tenant_classes.get(tenant or "", policy.default_class)
        return policy.classes[name]

    def degrade_for_slo(self, decision: Decision, n: int = 1) -> Decision:
        """A request predicted to miss its TTFT objective whose class says on_slo_miss = "degrade": it gets the
        actions of the tier one heavier than the one in force (the heaviest stays the heaviest), as far as its class
        lets them touch it. A tier that sheds its class refuses it (PolicyRejection 429 shed_under_load)."""
        tiers = self.policy.tiers
        cls = self.policy.classes.get(decision.client_class)
        if not tiers or cls is None:
            return decision
        index = next((i for i, tier in enumerate(tiers) if tier.name == decision.tier), -1)  # its model's tier
        tier = tiers[min(index + 1, len(tiers) - 1)]
        heavier = self._degrade(cls, decision.max_tokens, decision.logprobs, decision.max_prompt_tokens, n, tier)
        notes = tuple(f"{note} (slo)" for note in heavier.notes if note not in decision.notes)
        return dataclasses.replace(decision, max_tokens=heavier.max_tokens, logprobs=heavier.logprobs,
                                   max_prompt_tokens=heavier.max_prompt_tokens,
                                   kv_type=heavier.kv_type or decision.kv_type, notes=decision.notes + notes)

    def _degrade(self, cls: ClientClass, max_tokens: int, logprobs: int | None, prompt_limit: int,
                 n: int, tier: Tier | None) -> Decision:
        notes = []
        kv_type = ""
        if tier is not None:
            actions, allowed = tier.actions, set(cls.degradable)
            if cls.name in actions.shed_classes:
                raise PolicyRejection(429, "shed_under_load", f"class {cls.name!r} is shed while the server is in "
                                      f"degradation tier {tier.name!r}; retry later", actions.retry_after_s)
            if "cap_max_tokens" in allowed and actions.cap_max_tokens and max_tokens * n > actions.cap_max_tokens:
                capped = max(1, actions.cap_max_tokens // n)  # the cap counts every choice's tokens
                notes.append(f"max_tokens {max_tokens}->{capped}")
                max_tokens = capped
            if "logprobs" in allowed and logprobs is not None and actions.logprobs != "allow":
                if actions.logprobs == "refuse":
                    raise PolicyRejection(503, "logprobs_unavailable", f"logprobs are refused while the server is in "
                                          f"degradation tier {tier.name!r}", actions.retry_after_s, "logprobs")
                notes.append("logprobs stripped")
                logprobs = None
            if "max_prompt_tokens" in allowed and actions.max_prompt_tokens:
                prompt_limit = min(prompt_limit, actions.max_prompt_tokens)
                notes.append(f"max_prompt_tokens {prompt_limit}")
            if "kv_type" in allowed and actions.kv_type:
                kv_type = actions.kv_type
                notes.append(f"kv_type {kv_type}")
        return Decision(cls.name, cls.priority, max_tokens, logprobs, prompt_limit, kv_type,
                        tier.name if tier is not None else NORMAL, tuple(notes), ())

    def _admit(self, key_rule: ApiKeyRule | None, cls: ClientClass, model: str) -> tuple[str, ...]:
        """Rate limits and concurrency caps, per key and per class, across models and on this one; takes the
        concurrency slots."""
        limits = request_limits(key_rule, cls, model)
        for slot, _, cap, on in limits:
            if cap and self.active[slot] >= cap:
                raise concurrency_refusal(slot, cap, on)
        for slot, per_minute, _, on in limits:
            if wait := self.rate_limiter.acquire(slot, per_minute):
                raise rate_refusal(slot, per_minute, on, wait)
        slots = tuple(slot for slot, _, _, _ in limits)
        for slot in slots:
            self.active[slot] += 1
        return slots
