"""[[models]] in the serve config (issue 45): each table checked like the rest of the file (line, key, what was
expected), names once each, none beside a single model's keys; per-model settings over the server's; the
single-model keys as a one-entry table."""

import math

import pytest

from edge.config import MODEL_KV_TOKENS, ConfigError, ServeConfig, configured_models, load_config, model_config
from edge.models.spec import FOREVER, keep_alive_seconds

TWO = """keep_alive = "10m"
audit_log = "/var/log/edge/audit.log"

[[models]]
name = "chat"
model = "chat.gguf"
kv_type = "q8_0"
pinned = true

[[models]]
name = "code"
model = "/models/code.gguf"
keep_alive = -1
prefill_workers = 2
kv_cache_tokens = 4096
"""


def _load(tmp_path, text: str, **flags) -> ServeConfig:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return load_config(str(path), flags)


def test_models_tables_build_specs_and_per_model_configs(tmp_path):
    config = _load(tmp_path, TWO)
    chat, code = config.models
    assert (chat.name, chat.model, chat.keep_alive_s, chat.pinned) == ("chat", str(tmp_path / "chat.gguf"), 600, True)
    assert (code.name, code.model, code.keep_alive_s, code.pinned) == ("code", "/models/code.gguf", FOREVER, False)
    one, other = model_config(config, chat), model_config(config, code)
    assert (one.model, one.model_name, one.kv_type, one.prefill_workers) == (chat.model, "chat", "q8_0", 1)
    assert one.kv_cache_tokens == MODEL_KV_TOKENS  # not "all the budget left": the other models need theirs
    assert (other.kv_type, other.prefill_workers, other.kv_cache_tokens) == ("auto", 2, 4096)
    assert one.audit_log == "/var/log/edge/audit.log.chat" and one.models == ()
    assert configured_models(config, "/embedded.gguf") == config.models


def test_the_single_model_keys_are_a_one_entry_table(tmp_path):
    config = _load(tmp_path, 'model = "m/tiny.gguf"\n')
    (spec,) = configured_models(config, "/embedded.gguf")
    assert (spec.name, spec.model, spec.pinned, spec.keep_alive_s) == ("tiny", str(tmp_path / "m/tiny.gguf"), True,
                                                                       FOREVER)
    (embedded,) = configured_models(ServeConfig(model_name="smol"), "/e/embedded.gguf")
    assert (embedded.name, embedded.model) == ("smol", "/e/embedded.gguf")


INVALID = [
    ("bad per-model choice", TWO.replace('kv_type = "q8_0"', 'kv_type = "q9"'), "models[0].kv_type", 7,
     "expected one of ['auto', 'f16', 'q8_0', 'q4_0'], got 'q9'"),
    ("unknown key in a table", TWO.replace("pinned = true", "colour = 1"), "models[0].colour", 8,
     "unknown key; expected one of ["),
    ("server-wide key in a table", TWO.replace("pinned = true", "port = 1"), "models[0].port", 8, "unknown key"),
    ("no model path", TWO.replace('model = "chat.gguf"\n', ""), "models[0].model", 4, "missing"),
    ("empty name", TWO.replace('name = "chat"', 'name = ""'), "models[0].name", 5, "non-empty"),
    ("bad keep_alive", TWO.replace("keep_alive = -1", 'keep_alive = "soon"'), "models[1].keep_alive", 13,
     "expected a duration"),
    ("bool keep_alive", TWO.replace("keep_alive = -1", "keep_alive = true"), "models[1].keep_alive", 13,
     "expected a duration"),
    ("bad default keep_alive", TWO.replace('"10m"', '"10 minutes"'), "keep_alive", 1, "expected a duration"),
    ("below a knob's bound", TWO.replace("prefill_workers = 2", "prefill_workers = 0"), "models[1].prefill_workers",
     14, "expected a value >= 1"),
    ("the same name twice", TWO.replace('name = "code"', 'name = "chat"'), "models[1].name", None,
     "the name 'chat' is given to two models"),
    ("a single model's key beside", 'model = "x.gguf"\n' + TWO, "model", None, "not with [[models]]"),
    ("launch off", "launch = false\n" + TWO, "launch", None, "not with [[models]]"),
    ("ray", 'ray = "auto"\n' + TWO, "ray", None, "not with [[models]]"),
]


@pytest.mark.parametrize("name,text,key,line,words", INVALID, ids=[i[0] for i in INVALID])
def test_a_bad_models_table_is_refused_precisely(tmp_path, name, text, key, line, words):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    issue = next((i for i in info.value.issues if i.key == key), None)
    assert issue is not None, f"no issue for {key}: {info.value}"
    assert words in issue.message and issue.line == line, str(info.value)


@pytest.mark.parametrize("value,seconds", [("5m", 300), ("30s", 30), ("1h", 3600), ("1.5h", 5400), ("250ms", 0.25),
                                           (0, 0), ("0", 0), (90, 90), (2.5, 2.5), (-1, FOREVER), ("-1", FOREVER),
                                           ("-5m", FOREVER)])
def test_keep_alive_has_ollamas_meaning(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["", "5 minutes", "m", True, None, [], math.inf, "1e3s"])
def test_keep_alive_refuses_what_it_cannot_read(value):
    with pytest.raises(ValueError, match="expected a"):
        keep_alive_seconds(value)


def test_edge_serve_serves_models_tables_each_checked_at_its_load(tmp_path, monkeypatch):
    """The GGUFs are not read at start (a bad one fails alone, at its load): the app holds every model, none loaded."""
    from aiohttp import web

    from edge.cli import main
    from edge.state import MODELS
    path = tmp_path / "serve.toml"
    path.write_text(TWO.replace("/var/log/edge/audit.log", str(tmp_path / "audit.log")))
    served = {}
    monkeypatch.setattr(web, "run_app", lambda app, **kw: served.update(app=app))
    main(["serve", "--config", str(path)])
    models = served["app"][MODELS]
    assert models.names == ["chat", "code"] and {d["state"] for d in models.describe()} == {"unloaded"}
