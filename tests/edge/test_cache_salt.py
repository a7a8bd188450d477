"""A request's cache salt: per API key by default, a client's own salt only narrows, "shared" is explicit."""

import pytest

from edge.core.cache_salt import CacheSalter
from policies.loader import load_policy
from policies.reloader import removed_protections


def test_each_key_has_its_own_salt_and_a_copied_client_salt_does_not_cross_keys():
    salter = CacheSalter()
    a, b = salter.salt("key", "sha256:a", None), salter.salt("key", "sha256:b", None)
    assert a and b and a != b
    assert salter.salt("key", "sha256:a", None) == a  # stable, so a tenant's own prompts hit
    assert salter.salt("key", "sha256:a", None, "mine") not in (a, salter.salt("key", "sha256:b", None, "mine"))


def test_without_keys_the_tenant_separates_and_shared_scope_shares():
    salter = CacheSalter()
    assert salter.salt("key", None, "x") != salter.salt("key", None, "y")
    assert salter.salt("shared", "sha256:a", "x") == salter.salt("shared", "sha256:b", "y") == ""
    assert salter.salt("shared", "sha256:a", None, "s") == salter.salt("shared", "sha256:b", None, "s") != ""


def test_salts_cannot_be_computed_without_the_servers_secret():
    assert CacheSalter().salt("key", "sha256:a", None) != CacheSalter().salt("key", "sha256:a", None)


@pytest.mark.parametrize("text, scope", [("", "key"), ('[prefix_cache]\nscope = "shared"\n', "shared")])
def test_the_policy_names_the_scope(tmp_path, text, scope):
    path = tmp_path / "policy.toml"
    path.write_text("version = 1\n" + text)
    assert load_policy(path).prefix_cache_scope == scope


def test_a_reload_may_not_silently_share_the_prompt_caches(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text("version = 1\n")
    isolated = load_policy(path)
    path.write_text('version = 1\n[prefix_cache]\nscope = "shared"\n')
    assert removed_protections(isolated, load_policy(path)) == ["prefix_cache_isolation"]
    path.write_text('version = 1\nallow_weaker_protection = ["prefix_cache_isolation"]\n'
                    '[prefix_cache]\nscope = "shared"\n')
    assert removed_protections(isolated, load_policy(path)) == []


def test_keys_of_one_group_share_a_salt_and_a_client_salt_still_narrows():
    salter = CacheSalter()
    team_a = salter.salt("key", "sha256:a", None, group="team")
    assert team_a == salter.salt("key", "sha256:b", None, group="team")  # the group's keys share
    assert team_a != salter.salt("key", "sha256:c", None, group="other") != salter.salt("key", "sha256:a", None)
    assert salter.salt("key", "sha256:a", None, "mine", "team") not in (team_a, salter.salt("key", "sha256:a", None,
                                                                                         "mine"))


def test_the_policy_names_groups_of_listed_keys_each_in_one_group(tmp_path):
    from policies.loader import PolicyError
    path = tmp_path / "policy.toml"
    keys = "[classes.c]\n" + "".join(f'[[keys]]\nkey = "{k}"\nclass = "c"\n' for k in ("k1", "k2", "k3"))
    path.write_text('version = 1\n' + keys + '[[prefix_cache.groups]]\nname = "team"\nkeys = ["k1", "k2"]\n'
                    '[[prefix_cache.groups]]\nkeys = ["k3"]\n')
    assert load_policy(path).prefix_cache_groups == {"k1": "team", "k2": "team", "k3": "group1"}
    path.write_text('version = 1\n' + keys + '[[prefix_cache.groups]]\nkeys = ["k1", "nope"]\n'
                    '[[prefix_cache.groups]]\nkeys = ["k1"]\n')
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    text = str(caught.value)
    assert "prefix_cache.groups[0].keys[1]" in text and "not an API key" in text
    assert "prefix_cache.groups[1].keys[0]" in text and "in two groups" in text


def test_a_kept_secret_gives_the_same_salts_after_a_restart(tmp_path):
    """With the workers' disk tier a tenant's stored prefixes must keep their salt across a gateway restart."""
    path = tmp_path / "state" / "cache-salt.secret"
    first = CacheSalter(secret_file=path).salt("key", "sha256:a", None)
    assert path.stat().st_mode & 0o777 == 0o600
    assert CacheSalter(secret_file=path).salt("key", "sha256:a", None) == first
    assert CacheSalter(secret_file=path).salt("key", "sha256:b", None) != first
    assert CacheSalter().salt("key", "sha256:a", None) != first  # without the file: a fresh secret each start


def test_a_kept_secret_others_may_read_is_replaced(tmp_path):
    path = tmp_path / "cache-salt.secret"
    first = CacheSalter(secret_file=path).salt("key", "sha256:a", None)
    path.chmod(0o644)
    assert CacheSalter(secret_file=path).salt("key", "sha256:a", None) != first
    assert path.stat().st_mode & 0o777 == 0o600
    path.write_bytes(b"short")
    path.chmod(0o600)
    replaced = CacheSalter(secret_file=path)
    assert len(path.read_bytes()) == 32 and replaced.salt("key", "sha256:a", None) != first


def test_the_secret_is_kept_only_when_the_disk_tier_is_on(tmp_path):
    from edge.config import ServeConfig
    from edge.core.cache_salt import secret_file
    assert secret_file(ServeConfig()) is None
    assert secret_file(ServeConfig(kv_disk_bytes=1 << 30, kv_disk_dir=str(tmp_path))) == tmp_path / "cache-salt.secret"
