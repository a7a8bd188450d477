"""`edge serve` refuses, before it starts anything, a model file that is corrupt or hostile (contracts.gguf_check)
and a bind beyond loopback with nothing that authenticates a client, unless --allow-unauthenticated; each with
one line, never a traceback. The slow tests run the real command, as an operator does."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge.cli import main
from hostile_gguf import layout, write_copy

EDGE = Path(sys.executable).parent / "edge"  # the venv's console script
LAYERS_MESSAGE = "llama.block_count is 100000, above the bound 1024"


@pytest.fixture
def hostile_gguf(embedded_model_path, tmp_path) -> Path:
    """The embedded model's header claiming 100,000 layers (the file that made check-model hang)."""
    lay = layout(Path(embedded_model_path))
    return write_copy(tmp_path / "layers.gguf", lay.with_value(lay.keys["llama.block_count"].value, 100_000),
                      lay.size)


def serve(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *map(str, argv)])
    assert "Traceback" not in capsys.readouterr().err
    return str(exit_info.value.code)


def test_a_hostile_model_is_refused_before_anything_starts(capsys, hostile_gguf, monkeypatch):
    import edge.app
    monkeypatch.setattr(edge.app, "make_app", lambda config: pytest.fail("the app was built for a hostile model"))
    assert serve(capsys, "--model", hostile_gguf) == f"edge: {hostile_gguf}: {LAYERS_MESSAGE}"


def test_a_corrupt_model_is_refused_with_a_message(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    message = serve(capsys, "--model", corrupt)
    assert message.startswith(f"edge: {corrupt}: ") and "tensor count" in message


def test_an_open_bind_without_keys_is_refused(capsys):
    message = serve(capsys, "--host", "0.0.0.0", "--port", "0")
    assert message.startswith("edge: refusing to serve on 0.0.0.0:0 with no API keys in the policy")
    assert "--allow-unauthenticated" in message


def test_with_the_opt_in_an_open_bind_starts_and_says_so_loudly(capsys, caplog, monkeypatch):
    import edge.app

    def stop_here(config):
        raise ValueError("stopped before the server starts")
    monkeypatch.setattr(edge.app, "make_app", stop_here)
    with caplog.at_level(logging.WARNING, logger="edge"):
        assert serve(capsys, "--host", "0.0.0.0", "--port", "0", "--allow-unauthenticated") == \
            "edge: stopped before the server starts"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("OPEN SERVICE: listening on 0.0.0.0:0 with NO AUTHENTICATION") for w in warnings)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["check-model"], ["serve", "--port", "0", "--model"]], ids=["check-model", "serve"])
def test_the_commands_refuse_a_hostile_file_within_seconds(hostile_gguf, command):
    began = time.monotonic()
    done = subprocess.run([str(EDGE), *command, str(hostile_gguf)], capture_output=True, text=True, timeout=60)
    took_s = time.monotonic() - began
    assert done.returncode != 0 and took_s < 10.0, (took_s, done.stdout, done.stderr)
    assert LAYERS_MESSAGE in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_the_opt_in_is_a_config_key_too(capsys, monkeypatch, tmp_path):
    import edge.app

    def stop_here(config):
        raise ValueError(f"stopped with allow_unauthenticated={config.allow_unauthenticated}")
    monkeypatch.setattr(edge.app, "make_app", stop_here)
    config = tmp_path / "serve.toml"
    config.write_text('host = "0.0.0.0"\nport = 0\nallow_unauthenticated = true\n')
    assert serve(capsys, "--config", config) == "edge: stopped with allow_unauthenticated=True"
    config.write_text('host = "0.0.0.0"\nport = 0\nallow_unauthenticated = false\n')
    assert serve(capsys, "--config", config).startswith("edge: refusing to serve on 0.0.0.0:0")
