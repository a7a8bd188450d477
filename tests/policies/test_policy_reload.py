"""A reload may not silently remove a protection: one that would drop every API key, every blocked word and
pattern, or every rate and concurrency limit is refused (the policy in force stays) unless the new file
says so in allow_weaker_protection; narrowing a protection without removing it is an ordinary reload."""

import pytest

from policies.enforcer import PolicyEnforcer
from policies.loader import load_policy
from policies.reloader import PolicyReloader

GUARDED = """version = 1
[filters]
blocked_words = ["forbidden"]
blocked_patterns = ["secret\\\\d+"]
[classes.default]
requests_per_minute = 60
[classes.batch]
max_concurrent = 4
[[keys]]
key = "k1"
class = "default"
[[keys]]
key = "k2"
class = "batch"
"""
NO_KEYS = GUARDED[:GUARDED.index("[[keys]]")]
NO_CONTENT_RULES = (GUARDED.replace('blocked_words = ["forbidden"]\n', "")
                    .replace('blocked_patterns = ["secret\\\\d+"]\n', ""))
NO_LIMITS = GUARDED.replace("requests_per_minute = 60\n", "").replace("max_concurrent = 4\n", "")


def start(tmp_path, text: str) -> PolicyReloader:
    """The policy loaded at start-up (never refused: there is nothing to weaken), and its reloader."""
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return PolicyReloader(str(path), PolicyEnforcer(load_policy(path)))


def reload_with(reloader: PolicyReloader, text: str) -> bool:
    with open(reloader.path, "w") as fh:
        fh.write(text)
    return reloader.reload()


@pytest.mark.parametrize("text,protection,words", [
    (NO_KEYS, "keys", "every API key"),
    (NO_CONTENT_RULES, "blocked_content", "every blocked word and pattern"),
    (NO_LIMITS, "rate_limits", "every requests_per_minute and max_concurrent limit"),
], ids=["keys", "blocked_content", "rate_limits"])
def test_a_reload_that_removes_a_protection_is_refused(tmp_path, text, protection, words):
    reloader = start(tmp_path, GUARDED)
    before = reloader.enforcer.policy
    assert reload_with(reloader, text) is False
    assert reloader.enforcer.policy is before and reloader.failures == 1 and reloader.reloads == 0
    assert words in reloader.last_error and f'allow_weaker_protection = ["{protection}"]' in reloader.last_error


@pytest.mark.parametrize("text", ["", "version = 1\n"], ids=["empty", "version only"])
def test_an_empty_file_names_everything_it_would_remove(tmp_path, text):
    reloader = start(tmp_path, GUARDED)
    assert reload_with(reloader, text) is False
    assert 'allow_weaker_protection = ["keys", "blocked_content", "rate_limits"]' in reloader.last_error
    assert reloader.enforcer.auth_required


@pytest.mark.parametrize("text,allowed", [
    (NO_KEYS, "keys"), (NO_CONTENT_RULES, "blocked_content"), (NO_LIMITS, "rate_limits"),
], ids=["keys", "blocked_content", "rate_limits"])
def test_the_new_file_may_allow_the_removal(tmp_path, text, allowed):
    reloader = start(tmp_path, GUARDED)
    assert reload_with(reloader, f'allow_weaker_protection = ["{allowed}"]\n' + text) is True
    assert reloader.last_error is None and reloader.enforcer.policy.allow_weaker_protection == (allowed,)


def test_allowing_one_removal_does_not_allow_another(tmp_path):
    reloader = start(tmp_path, GUARDED)
    assert reload_with(reloader, 'allow_weaker_protection = ["keys"]\n' + NO_KEYS.replace('["forbidden"]', "[]")
                       .replace('["secret\\\\d+"]', "[]")) is False
    assert '["blocked_content"]' in reloader.last_error and "API key" not in reloader.last_error


def test_narrowing_is_a_normal_reload_and_only_the_last_removal_is_refused(tmp_path):
    reloader = start(tmp_path, "version = 1\n")  # open: no keys, no rules, no limits
    assert reload_with(reloader, GUARDED) is True  # adding protections
    assert reload_with(reloader, GUARDED[:GUARDED.index('[[keys]]\nkey = "k2"')]) is True  # one key of two
    assert set(reloader.enforcer.policy.keys) == {"k1"}
    assert reload_with(reloader, NO_KEYS) is False  # the last one
    assert set(reloader.enforcer.policy.keys) == {"k1"} and reloader.reloads == 2 and reloader.failures == 1
