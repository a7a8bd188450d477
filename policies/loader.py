"""Read and validate a policy file. Every mistake is reported with the file, the key path, the line
where it can be found, and what was expected; nothing half-valid is ever returned."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from policies.schema import (ACTIONS, SIGNALS, ApiKeyRule, ClientClass, Filters, Policy, Tier, TierActions)

KV_TYPES = ("", "f16", "q8_0", "q4_0")
LOGPROBS_MODES = ("allow", "strip", "refuse")
TOP_LEVEL = {"version", "default_class", "filters", "classes", "keys", "tenants", "tiers"}


@dataclass(frozen=True)
class PolicyIssue:
    key: str  # dotted key path, e.g. tiers[1].actions.logprobs
    message: str  # what is wrong and what was expected
    line: int | None = None


class PolicyError(ValueError):
    def __init__(self, source: str, issues: list[PolicyIssue]) -> None:
        self.source, self.issues = source, issues
        super().__init__("\n".join(f"{source}:{i.line or '?'}: {i.key}: {i.message}" for i in issues))


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise PolicyError(str(path), [PolicyIssue("(file)", f"cannot read the file: {err.strerror}")]) from None
    return parse_policy(text, str(path))


def parse_policy(text: str, source: str) -> Policy:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        line = re.search(r"line (\d+)", str(err))
        raise PolicyError(source, [PolicyIssue("(syntax)", f"not valid TOML: {err}",
                                               int(line.group(1)) if line else None)]) from None
    checker = _Checker(text)
    policy = checker.policy(data, source)
    if checker.issues:
        raise PolicyError(source, checker.issues)
    return policy


class _Checker:
    def __init__(self, text: str) -> None:
        self.lines = _key_lines(text)
        self.issues: list[PolicyIssue] = []

    def fail(self, key: str, message: str) -> None:
        self.issues.append(PolicyIssue(key, message, self._line(key)))

    def _line(self, key: str) -> int | None:
        while key:
            if key in self.lines:
                return self.lines[key]
            key = re.sub(r"(\.[^.\[\]]+|\[\d+\])$", "", key) if re.search(r"(\.[^.\[\]]+|\[\d+\])$", key) else ""
        return None

    # --- typed getters: record an issue and return a safe default on a bad value ---
    def get(self, table: dict, key: str, where: str, kind, default, minimum=None):
        if key not in table:
            return default
        value, path = table[key], f"{where}.{key}" if where else key
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(path, f"expected {_kind_name(kind)}, got {type(value).__name__} {value!r}")
            return default
        if minimum is not None and value < minimum:
            self.fail(path, f"expected a value >= {minimum}, got {value}")
            return default
        return value

    def strings(self, table: dict, key: str, where: str) -> tuple[str, ...]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(f"{where}.{key}" if where else key, f"expected a list of strings, got {value!r}")
            return ()
        return tuple(value)

    def known_keys(self, table: dict, allowed: set[str], where: str) -> None:
        for key in table:
            if key not in allowed:
                self.fail(f"{where}.{key}" if where else key,
                          f"unknown key; expected one of {sorted(allowed)}")

    def table(self, data: dict, key: str, where: str = "") -> dict:
        value = data.get(key, {})
        if not isinstance(value, dict):
            self.fail(f"{where}.{key}" if where else key, f"expected a table, got {type(value).__name__}")
            return {}
        return value

    # --- sections ---
    def policy(self, data: dict, source: str) -> Policy:
        self.known_keys(data, TOP_LEVEL, "")
        if data.get("version", 1) != 1:
            self.fail("version", f"this build reads policy version 1, the file says {data.get('version')!r}")
        filters = self.filters(self.table(data, "filters"))
        classes = self.classes(self.table(data, "classes"))
        default_class = self.get(data, "default_class", "", str, next(iter(classes), "default"))
        if classes and default_class not in classes:
            self.fail("default_class", f"class {default_class!r} is not defined; defined: {sorted(classes)}")
        keys = self.keys(data.get("keys", []), classes)
        header, tenant_classes = self.tenants(self.table(data, "tenants"), classes)
        tiers = self.tiers(data.get("tiers", []), classes)
        return Policy(source, filters, classes or {"default": ClientClass("default")}, default_class, keys,
                      header, tenant_classes, tiers)

    def filters(self, table: dict) -> Filters:
        self.known_keys(table, {"max_prompt_tokens", "max_output_tokens", "allowed_models", "blocked_words",
                                "blocked_patterns"}, "filters")
        patterns = self.strings(table, "blocked_patterns", "filters")
        for i, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as err:
                self.fail(f"filters.blocked_patterns[{i}]", f"not a valid regular expression ({err}): {pattern!r}")
        return Filters(self.get(table, "max_prompt_tokens", "filters", int, 2048, 1),
                       self.get(table, "max_output_tokens", "filters", int, 2048, 1),
                       self.strings(table, "allowed_models", "filters"),
                       self.strings(table, "blocked_words", "filters"), patterns)

    def classes(self, table: dict) -> dict[str, ClientClass]:
        classes = {}
        for name, spec in table.items():
            where = f"classes.{name}"
            if not isinstance(spec, dict):
                self.fail(where, f"expected a table, got {type(spec).__name__}")
                continue
            self.known_keys(spec, {"priority", "requests_per_minute", "max_concurrent", "max_output_tokens",
                                   "degradable"}, where)
            degradable = self.strings(spec, "degradable", where) if "degradable" in spec else ACTIONS
            for action in degradable:
                if action not in ACTIONS:
                    self.fail(f"{where}.degradable", f"unknown action {action!r}; expected any of {list(ACTIONS)}")
            classes[name] = ClientClass(name, self.get(spec, "priority", where, int, 0),
                                        self.get(spec, "requests_per_minute", where, int, 0, 0),
                                        self.get(spec, "max_concurrent", where, int, 0, 0),
                                        self.get(spec, "max_output_tokens", where, int, 0, 0), tuple(degradable))
        return classes

    def keys(self, entries, classes: dict) -> dict[str, ApiKeyRule]:
        if not isinstance(entries, list):
            self.fail("keys", "expected an array of tables ([[keys]])")
            return {}
        rules: dict[str, ApiKeyRule] = {}
        for i, entry in enumerate(entries):
            where = f"keys[{i}]"
            if not isinstance(entry, dict):
                self.fail(where, "expected a table with key and class")
                continue
            self.known_keys(entry, {"key", "class", "requests_per_minute", "max_concurrent"}, where)
            key = self.get(entry, "key", where, str, "")
            cls = self.get(entry, "class", where, str, "")
            if not key:
                self.fail(f"{where}.key", "expected a non-empty API key string")
            elif key in rules:
                self.fail(f"{where}.key", "this API key is listed twice")
            if cls not in classes:
                self.fail(f"{where}.class", f"class {cls!r} is not defined; defined: {sorted(classes)}")
            rules[key] = ApiKeyRule(key, cls, self.get(entry, "requests_per_minute", where, int, 0, 0),
                                    self.get(entry, "max_concurrent", where, int, 0, 0))
        return rules

    def tenants(self, table: dict, classes: dict) -> tuple[str, dict[str, str]]:
        self.known_keys(table, {"header", "classes"}, "tenants")
        mapping = self.table(table, "classes", "tenants")
        for tenant, cls in mapping.items():
            if cls not in classes:
                self.fail(f"tenants.classes.{tenant}", f"class {cls!r} is not defined; defined: {sorted(classes)}")
        return self.get(table, "header", "tenants", str, ""), {k: str(v) for k, v in mapping.items()}

    def tiers(self, entries, classes: dict) -> tuple[Tier, ...]:
        if not isinstance(entries, list):
            self.fail("tiers", "expected an array of tables ([[tiers]])")
            return ()
        tiers, names = [], set()
        for i, entry in enumerate(entries):
            where = f"tiers[{i}]"
            if not isinstance(entry, dict):
                self.fail(where, "expected a table")
                continue
            self.known_keys(entry, {"name", "enter", "exit", "min_dwell_s", "actions"}, where)
            name = self.get(entry, "name", where, str, f"tier{i}")
            if name in names:
                self.fail(f"{where}.name", f"tier name {name!r} is used twice")
            names.add(name)
            enter = self.conditions(self.table(entry, "enter", where), f"{where}.enter")
            exit_ = self.conditions(self.table(entry, "exit", where), f"{where}.exit")
            if not enter:
                self.fail(f"{where}.enter", "expected at least one signal threshold, e.g. enter = { kv_cache_usage = 0.8 }")
            if not exit_:
                self.fail(f"{where}.exit", "expected exit thresholds below the enter ones (hysteresis)")
            for signal, threshold in exit_.items():
                if signal in enter and threshold >= enter[signal]:
                    self.fail(f"{where}.exit.{signal}", f"exit threshold {threshold} must be below the enter "
                                                        f"threshold {enter[signal]}, or the tier would flap")
            actions = self.actions(self.table(entry, "actions", where), f"{where}.actions", classes)
            tiers.append(Tier(name, enter, exit_, self.get(entry, "min_dwell_s", where, float, 10.0, 0.0), actions))
        return tuple(tiers)

    def conditions(self, table: dict, where: str) -> dict[str, float]:
        out = {}
        for signal, value in table.items():
            if signal not in SIGNALS:
                self.fail(f"{where}.{signal}", f"unknown signal; expected one of {sorted(SIGNALS)}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                self.fail(f"{where}.{signal}", f"expected a number, got {value!r}")
            else:
                out[signal] = float(value)
        return out

    def actions(self, table: dict, where: str, classes: dict) -> TierActions:
        self.known_keys(table, {"cap_max_tokens", "logprobs", "max_prompt_tokens", "shed_classes",
                                "retry_after_s", "kv_type"}, where)
        logprobs = self.get(table, "logprobs", where, str, "allow")
        if logprobs not in LOGPROBS_MODES:
            self.fail(f"{where}.logprobs", f"expected one of {list(LOGPROBS_MODES)}, got {logprobs!r}")
        kv_type = self.get(table, "kv_type", where, str, "")
        if kv_type not in KV_TYPES:
            self.fail(f"{where}.kv_type", f"expected one of {[k for k in KV_TYPES if k]}, got {kv_type!r}")
        shed = self.strings(table, "shed_classes", where)
        for cls in shed:
            if cls not in classes:
                self.fail(f"{where}.shed_classes", f"class {cls!r} is not defined; defined: {sorted(classes)}")
        return TierActions(self.get(table, "cap_max_tokens", where, int, 0, 0), logprobs,
                           self.get(table, "max_prompt_tokens", where, int, 0, 0), shed,
                           self.get(table, "retry_after_s", where, int, 5, 1), kv_type)


def _kind_name(kind) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(kind, str(kind))


def _key_lines(text: str) -> dict[str, int]:
    """Map dotted key paths to the line that defines them (tables, arrays of tables, keys)."""
    lines, table, counters = {}, "", {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if match := re.fullmatch(r"\[\[\s*([\w.-]+)\s*\]\]", line):
            name = match.group(1)
            counters[name] = counters.get(name, -1) + 1
            table = f"{name}[{counters[name]}]"
            lines[table] = number
        elif match := re.fullmatch(r"\[\s*([\w.\-\"]+)\s*\]", line):
            name = match.group(1).replace('"', "")
            parent, _, child = name.rpartition(".")
            table = f"{parent}[{counters[parent]}].{child}" if parent in counters else name
            lines[table] = number
        elif match := re.match(r"([\w\-\"]+)\s*=", line):
            key = match.group(1).replace('"', "")
            lines.setdefault(f"{table}.{key}" if table else key, number)
    return lines
