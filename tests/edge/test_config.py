"""The serve config is checked like a policy file: each mistake in the file names the line, key and what was
expected; flags are checked the same way and named as flags; a good file and flags build ServeConfig."""

import pytest

from edge.config import ConfigError, Limits, ServeConfig, load_config, open_without_authentication

GOOD = """port = 9000
policy = "policy.toml"
worker_addresses = ["tcp://10.0.0.5:9101"]

[limits]
body_timeout_s = 5
"""

# (name, file text, key path in the error, line, words the message must contain)
INVALID = [
    ("not toml", "port = \n", "(syntax)", 1, "not valid TOML"),
    ("string for an integer", GOOD.replace("port = 9000", 'port = "9000"'), "port", 1,
     "expected an integer, got str '9000'"),
    ("unknown key", GOOD + "colour = 1\n", "limits.colour", 7, "unknown key; expected one of ['body_timeout_s'"),
    ("misspelled top-level key", "prot = 1\n" + GOOD, "prot", 1, "'port'"),
    ("bad choice", GOOD.replace("port = 9000", 'device = "tpu"'), "device", 1, "expected one of ['auto', 'cpu', 'cuda']"),
    ("below the minimum", GOOD + "max_body_bytes = 0\n", "limits.max_body_bytes", 7, "expected a value >= 1, got 0"),
    ("zero timeout", GOOD.replace("body_timeout_s = 5", "body_timeout_s = 0"), "limits.body_timeout_s", 6,
     "expected a value > 0"),
    ("bad list item", GOOD.replace('"tcp://10.0.0.5:9101"]', '"tcp://10.0.0.5:9101", 9102]'), "worker_addresses[1]",
     3, "expected a string, got int 9102"),
    ("table expected", GOOD.replace("[limits]\nbody_timeout_s = 5\n", "limits = 5\n"), "limits", 5,
     "expected a table, got int 5"),
]


@pytest.mark.parametrize("name,text,key,line,words", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_config_is_refused_precisely(tmp_path, name, text, key, line, words):
    path = tmp_path / "serve.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), {})
    issue = next((i for i in info.value.issues if i.key == key), None)
    assert issue is not None, f"no issue for {key}: {info.value}"
    assert words in issue.message and issue.line == line
    assert f"{path}:{line}: {key}:" in str(info.value)


def test_bad_flags_are_named_as_flags(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(GOOD)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), {"port": 70000, "log_level": "debug", "host": None})
    assert str(info.value).splitlines() == [
        "command line: --port: expected a value <= 65535, got 70000",
        "command line: --log-level: expected one of ['DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'], got 'debug'",
    ]


def test_file_and_flags_build_the_serve_config(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(GOOD)
    config = load_config(str(path), {"port": 9001, "model": None})
    assert config == ServeConfig(port=9001, policy=str(tmp_path / "policy.toml"),
                                 worker_addresses=("tcp://10.0.0.5:9101",), limits=Limits(body_timeout_s=5.0))
    # a policy path given as a flag is the operator's own, relative to where they run the command
    assert load_config(str(path), {"policy": "mine.toml"}).policy == "mine.toml"


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "absent.toml"), {})
    assert [(i.key, i.line) for i in info.value.issues] == [("(file)", None)]
    assert str(info.value).startswith(f"{tmp_path / 'absent.toml'}: (file): cannot read the file")


@pytest.mark.parametrize("host,keys,ca,open_to", [
    ("127.0.0.1", False, "", ""), ("localhost", False, "", ""), ("::1", False, "", ""),
    ("0.0.0.0", True, "", ""), ("0.0.0.0", False, "ca.pem", ""),  # keys or client certificates authenticate
    ("0.0.0.0", False, "", "0.0.0.0:8000"), ("10.1.2.3", False, "", "10.1.2.3:8000"), ("::", False, "", "[::]:8000"),
    ("gateway.internal", False, "", "gateway.internal:8000"), ("", False, "", "every interface, port 8000"),
])
def test_an_open_bind_is_one_beyond_loopback_with_nothing_that_authenticates(host, keys, ca, open_to):
    from policies.loader import parse_policy
    text = 'version = 1\n[[keys]]\nkey = "sk-test"\nclass = "default"\n' if keys else "version = 1\n"
    policy = parse_policy(text, "policy.toml")
    assert bool(policy.keys) is keys
    assert open_without_authentication(ServeConfig(host=host, ssl_ca_certs=ca), policy) == open_to
