"""Invalid policy files are each answered with a precise error: file, key path, line, what was expected.
The shipped policy files load; hot reload refuses a bad file and keeps the policy in force."""

from pathlib import Path

import pytest

from policies.enforcer import PolicyEnforcer
from policies.loader import PolicyError, load_policy, parse_policy
from policies.reloader import PolicyReloader

GOOD = """version = 1
default_class = "a"
[classes.a]
priority = 0
[[tiers]]
name = "busy"
enter = { kv_cache_usage = 0.7 }
exit = { kv_cache_usage = 0.5 }
[tiers.actions]
cap_max_tokens = 64
"""

# (name, file text, key path in the error, line, words the message must contain)
INVALID = [
    ("not toml", "version = 1\n[classes.a\n", "(syntax)", 2, "not valid TOML"),
    ("unknown top-level key", "colour = 'blue'\n" + GOOD, "colour", 1, "unknown key"),
    ("wrong version", GOOD.replace("version = 1", "version = 2"), "version", 1, "version 1"),
    ("negative priority type", GOOD.replace("priority = 0", 'priority = "high"'), "classes.a.priority", 4,
     "expected an integer"),
    ("undefined default class", GOOD.replace('default_class = "a"', 'default_class = "b"'), "default_class", 2,
     "class 'b' is not defined"),
    ("unknown signal", GOOD.replace("enter = { kv_cache_usage", "enter = { gpu_heat"), "tiers[0].enter.gpu_heat", 7,
     "unknown signal"),
    ("exit not below enter", GOOD.replace("exit = { kv_cache_usage = 0.5 }", "exit = { kv_cache_usage = 0.8 }"),
     "tiers[0].exit.kv_cache_usage", 8, "must be below the enter threshold"),
    ("missing exit", GOOD.replace("exit = { kv_cache_usage = 0.5 }\n", ""), "tiers[0].exit", 5, "hysteresis"),
    ("bad logprobs mode", GOOD + 'logprobs = "maybe"\n', "tiers[0].actions.logprobs", 11, "allow"),
    ("shed unknown class", GOOD + 'shed_classes = ["ghost"]\n', "tiers[0].actions.shed_classes", 11,
     "class 'ghost' is not defined"),
    ("bad regex", GOOD + '[filters]\nblocked_patterns = ["(unclosed"]\n', "filters.blocked_patterns[0]", 12,
     "not a valid regular expression"),
    ("key with unknown class", GOOD + '[[keys]]\nkey = "k1"\nclass = "zzz"\n', "keys[0].class", 13,
     "class 'zzz' is not defined"),
    ("duplicate key", GOOD + '[[keys]]\nkey = "k1"\nclass = "a"\n[[keys]]\nkey = "k1"\nclass = "a"\n',
     "keys[1].key", 15, "listed twice"),
    ("negative cap", GOOD.replace("cap_max_tokens = 64", "cap_max_tokens = -1"), "tiers[0].actions.cap_max_tokens",
     10, "expected a value >= 0"),
    ("bad kv type", GOOD + 'kv_type = "q2_k"\n', "tiers[0].actions.kv_type", 11, "q4_0"),
    ("unknown action in degradable", GOOD.replace("priority = 0", 'priority = 0\ndegradable = ["teleport"]'),
     "classes.a.degradable", 5, "unknown action 'teleport'"),
    # RE2 runs the patterns in linear time; what it cannot run is refused, each item at its own line
    ("backreference", GOOD + '[filters]\nblocked_patterns = [\n  "fine",\n  "(a)\\\\1",  # "quoted"\n]\n',
     "filters.blocked_patterns[1]", 14, "RE2 has no backreferences"),
    ("lookahead", GOOD + "[filters]\nblocked_patterns = ['x(?=y)']\n", "filters.blocked_patterns[0]", 12,
     "not a valid regular expression for RE2"),
    ("unknown protection", 'allow_weaker_protection = ["everything"]\n' + GOOD, "allow_weaker_protection[0]", 1,
     "expected one of ['keys', 'blocked_content', 'rate_limits', 'prefix_cache_isolation']"),
    ("nan threshold", GOOD.replace("enter = { kv_cache_usage = 0.7 }", "enter = { kv_cache_usage = nan }"),
     "tiers[0].enter.kv_cache_usage", 7, "expected a finite number"),
    ("string for a list", GOOD + '[filters]\nblocked_words = "bad"\n', "filters.blocked_words", 12,
     "expected a list of strings, got str 'bad'"),
]


@pytest.mark.parametrize("name,text,key,line,words", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_policy_is_refused_precisely(name, text, key, line, words):
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "/etc/edge/policy.toml")
    issue = next((i for i in info.value.issues if i.key == key), None)
    assert issue is not None, f"no issue for {key}: {info.value}"
    assert words in issue.message
    assert issue.line == line
    assert f"/etc/edge/policy.toml:{line}: {key}:" in str(info.value)


def test_all_mistakes_are_reported_together():
    text = GOOD.replace("priority = 0", 'priority = "x"') + 'logprobs = "maybe"\n'
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.toml")
    assert {i.key for i in info.value.issues} >= {"classes.a.priority", "tiers[0].actions.logprobs"}


def test_allow_weaker_protection_is_read():
    policy = parse_policy('allow_weaker_protection = ["keys", "rate_limits"]\n' + GOOD, "p.toml")
    assert policy.allow_weaker_protection == ("keys", "rate_limits")


@pytest.mark.parametrize("path", ["policies/default.toml", "policies/presets/interactive-first.toml",
                                  "policies/presets/batch-throughput.toml"])
def test_shipped_policies_load(path):
    policy = load_policy(Path(__file__).parents[2] / path)
    assert policy.tiers and policy.default_class in policy.classes


def test_hot_reload_refuses_a_bad_file_and_keeps_the_old_policy(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(GOOD)
    enforcer = PolicyEnforcer(load_policy(path))
    reloader = PolicyReloader(str(path), enforcer)
    assert reloader.poll() is None  # unchanged
    path.write_text(GOOD.replace("cap_max_tokens = 64", "cap_max_tokens = oops"))
    import os
    os.utime(path, ns=(1, 10**18))
    assert reloader.poll() is False
    assert enforcer.policy.tiers[0].actions.cap_max_tokens == 64 and "not valid TOML" in reloader.last_error
    path.write_text(GOOD.replace("cap_max_tokens = 64", "cap_max_tokens = 32"))
    os.utime(path, ns=(1, 2 * 10**18))
    assert reloader.poll() is True
    assert enforcer.policy.tiers[0].actions.cap_max_tokens == 32 and reloader.last_error is None


def test_a_policy_or_config_file_past_the_size_cap_is_refused_unread(tmp_path):
    """A 64 GiB file (sparse: nothing on disk) is refused at once, without reading it into memory."""
    import resource
    import time

    from edge.config import ConfigError, load_config
    from policies.validation import MAX_FILE_BYTES
    huge = tmp_path / "huge.toml"
    with open(huge, "wb") as file:
        file.truncate(1 << 36)  # reading it through would take minutes (a sparse GiB: 1 to 6 s here)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    with pytest.raises(PolicyError, match=f"larger than the limit of {MAX_FILE_BYTES} bytes"):
        load_policy(huge)
    with pytest.raises(ConfigError, match="larger than the limit"):
        load_config(str(huge), {})
    assert time.perf_counter() - started < 10.0  # at once; 10 s for a busy machine, far below reading it through
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: far below the file
    (tmp_path / "latin1.toml").write_bytes(b'version = 1\n# caf\xe9\n')
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(tmp_path / "latin1.toml")
