"""Start the real service (`edge serve`) as a subprocess for end-to-end tests, and stop it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """tls: the client side's context (the CA to trust, a client certificate for mutual TLS) when the config
    makes the server speak HTTPS; base, the readiness poll, health() and metric() then use https with it."""

    def __init__(self, config_text: str, workdir: Path, policy_text: str | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.port = free_port()
        self.config = workdir / "serve.toml"
        self.policy = workdir / "policy.toml"
        if policy_text is not None:
            self.policy.write_text(policy_text)
            config_text = f'policy = "{self.policy}"\n' + config_text
        self.config.write_text(config_text)
        self.log_path = workdir / "serve.log"
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.verify = tls or True  # httpx's default for everyone else
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, "-m", "edge.cli", "serve", "--config", str(self.config),
                                         "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2, verify=self.verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # the ready time is measured by this poll (tests/e2e/test_live_decisions.py)
        raise RuntimeError(f"server not healthy in {timeout_s} s:\n{self.log_path.read_text()[-3000:]}")

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=5, verify=self.verify).json()

    def metric(self, name: str, **labels: str) -> float:
        """The first sample of `name` whose labels include `labels`."""
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        for line in httpx.get(self.base + "/metrics", timeout=5, verify=self.verify).text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and all(w in line for w in wanted):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def child_pids(self) -> list[int]:
        return [p["pid"] for p in self.health()["processes"].values() if p["pid"]]

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def served(config_text: str, policy_text: str | None = None, name: str = "serve"):
    """A module-scoped `server` fixture: `edge serve` with this config and policy, started once for the module's
    tests (in a folder of its own, named after `name`) and stopped after the last. In a test module:
    `server = served(CONFIG, POLICY)`."""
    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        with ServerProcess(config_text, tmp_path_factory.mktemp(name), policy_text).start() as process:
            yield process
    return server


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout_s: float, interval: float = 0.05) -> bool:
    """Poll predicate until it holds or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
