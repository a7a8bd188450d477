"""Read and validate a policy file. Every mistake is reported with the file, the key path, the line
where it can be found, and what was expected; nothing half-valid is ever returned.

The pydantic models below say what each table may hold (policies/validation.py turns their errors into
file, line and key); the checks that relate one entry to another (duplicates, hysteresis) run on the
validated document. Both build the frozen dataclasses of policies/schema.py, which the rest of the code uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationInfo, create_model, field_validator

from policies.content_filter import pattern_error
from policies.schema import (
    ACTIONS,
    BELOW_SIGNALS,
    PROTECTIONS,
    SIGNALS,
    ApiKeyRule,
    AuditRules,
    ClientClass,
    Filters,
    ModelLimits,
    Policy,
    Tier,
    TierActions,
)
from policies.slo import ClassSloFields, slo_relations
from policies.validation import FileError, Invalid, Issue, Strict, issue_at, parse_toml, read_text, validate

PolicyIssue = Issue  # the name this module has always exported


class PolicyError(FileError):
    """A policy file that cannot be used; .issues has every mistake with its key path and line."""


def load_policy(path: str | Path) -> Policy:
    try:
        text = read_text(path)
    except Invalid as err:
        raise PolicyError(str(path), err.issues) from None
    return parse_policy(text, str(path))


def parse_policy(text: str, source: str) -> Policy:
    try:
        data, lines = parse_toml(text)
        document = validate(PolicyFile, data, lines, {"classes": _class_names(data)})
        if problems := [issue_at(lines, key, message) for key, message in _relations(document)]:
            raise Invalid(problems)
    except Invalid as err:
        raise PolicyError(source, err.issues) from None
    return document.build(source)


def _class_names(data: dict) -> set[str]:
    """The classes references may name: those the file defines, or the implicit "default" when none."""
    classes = data.get("classes")
    return set(classes) if isinstance(classes, dict) and classes else {"default"}


def _defined(names: list[str], info: ValidationInfo) -> list[str]:
    for name in names:
        if name not in info.context["classes"]:
            raise ValueError(f"class {name!r} is not defined; defined: {sorted(info.context['classes'])}")
    return names


def _defined_class(name: str, info: ValidationInfo) -> str:
    return _defined([name], info)[0]


def _regex(pattern: str) -> str:
    if reason := pattern_error(pattern):
        raise ValueError(f"not a valid regular expression for RE2 ({reason}; RE2 has no backreferences or "
                         f"lookaround): {pattern!r}")
    return pattern


def _key_name(name: str) -> str:
    if name.startswith("sha256:"):  # the audit log shows either a name or a hash: keep them apart
        raise ValueError(f"a key id may not start with 'sha256:' (the form of a key's hash), got {name!r}")
    return name


ClassName = Annotated[str, AfterValidator(_defined_class)]
ClassNames = Annotated[list[str], AfterValidator(_defined)]
NonNegative = Annotated[int, Field(ge=0)]


class FiltersFile(Strict):
    max_prompt_tokens: int = Field(2048, ge=1)
    max_output_tokens: int = Field(2048, ge=1)
    allowed_models: list[str] = []
    blocked_words: list[str] = []
    blocked_patterns: list[Annotated[str, AfterValidator(_regex)]] = []

    def build(self) -> Filters:
        return Filters(self.max_prompt_tokens, self.max_output_tokens, tuple(self.allowed_models),
                       tuple(self.blocked_words), tuple(self.blocked_patterns))


class ClassModelLimitsFile(Strict):
    """A class's limits on one model: its requests for that model together (issue 45)."""
    requests_per_minute: NonNegative = 0
    max_concurrent: NonNegative = 0

    def build(self) -> ModelLimits:
        return ModelLimits(self.requests_per_minute, self.max_concurrent)


class KeyModelLimitsFile(ClassModelLimitsFile):
    """A key's limits and token quotas on one model (issue 45)."""
    tokens_per_day: NonNegative = 0
    tokens_per_month: NonNegative = 0

    def build(self) -> ModelLimits:
        return ModelLimits(self.requests_per_minute, self.max_concurrent, self.tokens_per_day, self.tokens_per_month)


ModelName = Annotated[str, Field(min_length=1)]


class ClassFile(ClassSloFields):
    priority: int = 0
    requests_per_minute: NonNegative = 0
    max_concurrent: NonNegative = 0
    max_output_tokens: NonNegative = 0
    degradable: list[str] = list(ACTIONS)
    models: list[ModelName] = []  # empty: every served model
    model_limits: dict[str, ClassModelLimitsFile] = {}  # model -> the class's limits on it

    @field_validator("degradable")
    @classmethod
    def _known_actions(cls, actions: list[str]) -> list[str]:
        for action in actions:
            if action not in ACTIONS:
                raise ValueError(f"unknown action {action!r}; expected any of {list(ACTIONS)}")
        return actions

    def build(self, name: str) -> ClientClass:
        return ClientClass(name, self.priority, self.requests_per_minute, self.max_concurrent,
                           self.max_output_tokens, tuple(self.degradable), self.ttft_slo_ms, self.tpot_slo_ms,
                           self.on_slo_miss, self.min_ttft_slo_ms, tuple(self.models),
                           {model: limits.build() for model, limits in self.model_limits.items()})


class KeyFile(Strict):
    key: str = Field(min_length=1)
    client_class: ClassName = Field(alias="class")
    requests_per_minute: NonNegative = 0
    max_concurrent: NonNegative = 0
    tokens_per_day: NonNegative = 0
    tokens_per_month: NonNegative = 0
    id: Annotated[str, Field(min_length=1), AfterValidator(_key_name)] | None = None
    admin: bool = False
    models: list[ModelName] = []  # empty: what its class allows
    model_limits: dict[str, KeyModelLimitsFile] = {}  # model -> the key's limits and quotas on it

    def build(self) -> ApiKeyRule:
        return ApiKeyRule(self.key, self.client_class, self.requests_per_minute, self.max_concurrent,
                          self.tokens_per_day, self.tokens_per_month, self.id or "", self.admin, tuple(self.models),
                          {model: limits.build() for model, limits in self.model_limits.items()})


class AuditFile(Strict):
    log_text: bool = False


class CacheGroupFile(Strict):
    name: str | None = None  # None: group<index>
    keys: list[str] = Field(min_length=1)


class PrefixCacheFile(Strict):
    scope: Literal["key", "shared"] = "key"
    groups: list[CacheGroupFile] = []  # keys that share one prompt cache (one team's keys, a public system prompt)

    def group_of_keys(self) -> dict[str, str]:
        return {key: group.name or f"group{i}" for i, group in enumerate(self.groups) for key in group.keys}


class TenantsFile(Strict):
    header: str = ""
    classes: dict[str, ClassName] = {}


class ThresholdsBase(Strict):
    unknown_key_noun = "signal"


# one optional number per load signal: { kv_cache_usage = 0.8, waiting_requests = 16 }
Thresholds = create_model("Thresholds", __base__=ThresholdsBase, **{s: (float | None, None) for s in SIGNALS})


class ActionsFile(Strict):
    cap_max_tokens: NonNegative = 0
    logprobs: Literal["allow", "strip", "refuse"] = "allow"
    max_prompt_tokens: NonNegative = 0
    shed_classes: ClassNames = []
    retry_after_s: int = Field(5, ge=1)
    kv_type: Literal["f16", "q8_0", "q4_0"] | None = None  # None keeps the configured KV type
    speculative: bool = True  # false: speculative decoding off while the tier holds

    def build(self) -> TierActions:
        return TierActions(self.cap_max_tokens, self.logprobs, self.max_prompt_tokens, tuple(self.shed_classes),
                           self.retry_after_s, self.kv_type or "", self.speculative)


class TierFile(Strict):
    name: str | None = None  # None: tier<index>
    enter: Thresholds = Thresholds()
    exit: Thresholds = Thresholds()
    min_dwell_s: float = Field(10.0, ge=0)
    actions: ActionsFile = ActionsFile()

    def build(self, name: str) -> Tier:
        return Tier(name, self.enter.model_dump(exclude_none=True), self.exit.model_dump(exclude_none=True),
                    self.min_dwell_s, self.actions.build())


class PolicyFile(Strict):
    version: int = 1
    default_class: ClassName | None = None  # None: the first class defined
    allow_weaker_protection: list[Literal[tuple(PROTECTIONS)]] = []
    filters: FiltersFile = FiltersFile()
    classes: dict[str, ClassFile] = {}
    keys: list[KeyFile] = []
    tenants: TenantsFile = TenantsFile()
    tiers: list[TierFile] = []
    audit: AuditFile = AuditFile()
    prefix_cache: PrefixCacheFile = PrefixCacheFile()

    @field_validator("version")
    @classmethod
    def _this_version(cls, version: int) -> int:
        if version != 1:
            raise ValueError(f"this build reads policy version 1, the file says {version!r}")
        return version

    def tier_names(self) -> list[str]:
        return [tier.name or f"tier{i}" for i, tier in enumerate(self.tiers)]

    def build(self, source: str) -> Policy:
        classes = {name: spec.build(name) for name, spec in self.classes.items()} or {"default": ClientClass("default")}
        tiers = tuple(tier.build(name) for tier, name in zip(self.tiers, self.tier_names()))
        return Policy(source, self.filters.build(), classes, self.default_class or next(iter(classes)),
                      {entry.key: entry.build() for entry in self.keys}, self.tenants.header,
                      dict(self.tenants.classes), tiers, tuple(self.allow_weaker_protection),
                      AuditRules(self.audit.log_text), self.prefix_cache.scope, self.prefix_cache.group_of_keys())


# --- checks that relate entries to each other: (key path, message) for each mistake ---
def _relations(document: PolicyFile) -> Iterator[tuple[str, str]]:
    yield from _duplicates([entry.key for entry in document.keys], "keys[{}].key",
                           lambda key: "this API key is listed twice")
    yield from _duplicates([entry.id for entry in document.keys], "keys[{}].id",
                           lambda name: f"key id {name!r} is used twice (the audit log could not tell them apart)")
    yield from _duplicates(document.tier_names(), "tiers[{}].name", lambda name: f"tier name {name!r} is used twice")
    for i, tier in enumerate(document.tiers):
        yield from _hysteresis(tier, f"tiers[{i}]")
    yield from _cache_groups(document)
    yield from _model_limits(document)
    yield from slo_relations(document.classes, len(document.tiers))


def _cache_groups(document: PolicyFile) -> Iterator[tuple[str, str]]:
    """A group names listed keys only, each in one group at most (a key in two would join their caches)."""
    listed, grouped = {entry.key for entry in document.keys}, set()
    for i, group in enumerate(document.prefix_cache.groups):
        for j, key in enumerate(group.keys):
            where = f"prefix_cache.groups[{i}].keys[{j}]"
            if key not in listed:
                yield where, "not an API key of [[keys]] (a group shares the cache of listed keys only)"
            elif key in grouped:
                yield where, "this API key is in two groups; a key shares the cache of one group at most"
            grouped.add(key)
    yield from _duplicates([group.name for group in document.prefix_cache.groups], "prefix_cache.groups[{}].name",
                           lambda name: f"group name {name!r} is used twice")


def _model_limits(document: PolicyFile) -> Iterator[tuple[str, str]]:
    """A per-model limit names a model its key or class may use (else it could never apply: a mistake, most likely
    a misspelled name); a model name is never empty."""
    allowed = document.filters.allowed_models
    for name, spec in document.classes.items():
        yield from _usable(spec.model_limits, f"classes.{name}", spec.models, allowed, "class")
    for i, entry in enumerate(document.keys):
        spec = document.classes.get(entry.client_class)
        own = entry.models or (spec.models if spec is not None else [])
        yield from _usable(entry.model_limits, f"keys[{i}]", own, allowed, "key")


def _usable(limits: dict, where: str, own: list[str], allowed: list[str], who: str) -> Iterator[tuple[str, str]]:
    """own: the models the key or class names (empty: any); allowed: the filters' allowed_models (empty: any)."""
    for model in limits:
        if not model:
            yield f"{where}.model_limits", "a model's name may not be empty"
        elif own and model not in own or allowed and model not in allowed:
            usable = sorted(set(own or allowed) & set(allowed or own))
            yield (f"{where}.model_limits.{model}", f"this {who} may not use model {model!r} (it may use "
                                                    f"{usable}): a limit on it would never apply")


def _duplicates(values: list[str | None], where: str, message) -> Iterator[tuple[str, str]]:
    """None (a key without an id) is never a duplicate."""
    seen: set[str | None] = set()
    for i, value in enumerate(values):
        if value is not None and value in seen:
            yield where.format(i), message(value)
        seen.add(value)


def _hysteresis(tier: TierFile, where: str) -> Iterator[tuple[str, str]]:
    enter, exit_ = tier.enter.model_dump(exclude_none=True), tier.exit.model_dump(exclude_none=True)
    if not enter:
        yield f"{where}.enter", "expected at least one signal threshold, e.g. enter = { kv_cache_usage = 0.8 }"
    if not exit_:
        yield f"{where}.exit", "expected exit thresholds below the enter ones (hysteresis)"
    for signal, threshold in exit_.items():
        if signal in BELOW_SIGNALS and signal in enter and threshold <= enter[signal]:
            yield (f"{where}.exit.{signal}", f"exit threshold {threshold} must be above the enter threshold "
                                             f"{enter[signal]} ({signal} enters below its threshold), or the tier "
                                             f"would flap")
        elif signal not in BELOW_SIGNALS and signal in enter and threshold >= enter[signal]:
            yield (f"{where}.exit.{signal}", f"exit threshold {threshold} must be below the enter threshold "
                                             f"{enter[signal]}, or the tier would flap")
