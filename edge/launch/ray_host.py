"""The Ray actor that runs one edge process on its node: a prefill worker or a decode engine.

The process is the same `python -m prefill_cpu.worker` / `decode_gpu.service.server` that single-box mode starts, with
the typed config the gateway built (contracts.process_config), on a TCP port of this node, and it speaks the same
authenticated protocol (contracts.framing): the secret arrives in the actor's arguments, so it travels through Ray,
never through a port. The actor only hosts it:
- `address()` says where it listens (at once), `ready()` the same once it accepts connections;
- the process dies with the actor (edge.launch.child_main's parent-death signal), and the actor dies with the process
  (os._exit), so Ray's max_restarts restarts the pair, wherever resources allow. A prefill worker has no engine of
  its own: each job names its engine, so an engine's restart does not touch the workers.
Imported only on the Ray path; the class is made an actor by edge.launch.ray_placement with its resource requests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

from contracts.framing import SECRET_ENV
from contracts.process_config import EngineProcessConfig, WorkerProcessConfig, config_argv
from edge.launch.launcher import child_environment

log = logging.getLogger("edge.launch.ray_host")
EMBEDDED_MODEL = "embedded"  # a model value each node resolves to its own copy of the embedded model
STOP_TIMEOUT_S = 10.0


class ProcessHost:
    def __init__(self, name: str, module: str, config: EngineProcessConfig | WorkerProcessConfig, secret: str) -> None:
        import ray
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
        self.name = name
        self.port = _free_port()
        self.tcp_address = f"tcp://{ray.util.get_node_ip_address()}:{self.port}"
        self.stopping = False
        self.exited = threading.Event()
        self.returncode: int | None = None
        config = dataclasses.replace(config, model=_model_here(config.model), listen=f"tcp://0.0.0.0:{self.port}")
        env = child_environment()
        env[SECRET_ENV] = secret
        started = threading.Event()
        self.process: subprocess.Popen | None = None
        argv = [sys.executable, "-m", "edge.launch.child_main", module, *config_argv(config)]
        threading.Thread(target=self._run, args=(argv, env, started), name="child", daemon=True).start()
        started.wait()

    def _run(self, argv: list[str], env: dict, started: threading.Event) -> None:
        """Starts the child and lives as long as it does: the parent-death signal follows this thread."""
        self.process = subprocess.Popen(argv, env=env, process_group=0)
        log.info("%s started (pid %d) on %s", self.name, self.process.pid, self.tcp_address)
        started.set()
        self.returncode = self.process.wait()
        self.exited.set()
        if not self.stopping:
            log.error("%s exited with code %s; ending its actor so that Ray restarts both", self.name, self.returncode)
            os._exit(1)

    def address(self) -> str:
        return self.tcp_address

    def ready(self, timeout_s: float = 600.0) -> str:
        """The address, once the process listens there (once its model is loaded)."""
        deadline = time.monotonic() + timeout_s
        while not self._listening() and not self.exited.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.tcp_address

    def _listening(self) -> bool:
        try:
            connections = psutil.Process(self.process.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in connections)

    def wait_stopped(self) -> int | None:
        """Returns when the process exits; a caller sees RayActorError if the actor dies first (node lost)."""
        self.exited.wait()
        return self.returncode

    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self.stopping = True
        self._terminate()

    def _terminate(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        if not self.exited.wait(STOP_TIMEOUT_S):
            os.killpg(self.process.pid, signal.SIGKILL)


def _model_here(model: str) -> str:
    if model != EMBEDDED_MODEL:
        return model
    from prefill_cpu.embedded_model import embedded_model_path
    return embedded_model_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]
