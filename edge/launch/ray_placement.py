"""`edge serve --ray`: the prefill workers and decode engines as Ray actors, placed by their resource requests.

The gateway joins the Ray cluster, starts one actor per process (edge.launch.ray_host) in a namespace of its own, and
finds each process through its actor: the prefill pool and the engine clients ask `ready()` for the address before
every connection, so a process that Ray restarted on another node is found again. The KV handoff stays a direct
TCP stream from worker to engine (docs/cluster.md says why). A worker has no engine of its own: the gateway names
the engine in each job (edge.core.engine_group chooses it), and the worker links to each engine it is told of.

Failures: a watcher per actor waits on it through Ray; when the actor or its process dies, the gateway drops that
connection at once, which fails the worker's prompt (worker_died) or ends the engine's streams
(engine_unavailable). Ray restarts the actor (max_restarts); the gateway routes to it again once it has passed the
handshake and said it is ready, as in single-box mode. Gateway shutdown stops every actor it started.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import ray

from edge.config import ServeConfig
from edge.launch.launcher import engine_config, worker_config
from edge.launch.ray_host import EMBEDDED_MODEL, ProcessHost

log = logging.getLogger("edge.cluster")
READY_TIMEOUT_S = 120.0  # one wait for an actor to listen (an engine loads its model first); then asked again
CONNECT_TIMEOUT_S = 5.0  # an address that does not answer is stale (its node went away): ask Ray again
STOP_TIMEOUT_S = 15.0
RETRY_S = 1.0  # between watches of an actor Ray cannot reach


class RayPlacement:
    def __init__(self, config: ServeConfig, secret: str, on_down: Callable[[str, str], None]) -> None:
        self.config = config
        self.secret = secret
        self.namespace = f"edge-{uuid.uuid4().hex[:8]}"  # two gateways on one cluster do not share actors
        self.engines = [f"decode-{i}" for i in range(config.decode_engines)]
        self.workers = [f"prefill-{i}" for i in range(config.prefill_workers)]
        self.hosts: dict[str, ray.actor.ActorHandle] = {}
        self.on_down = on_down  # (name, reason): the gateway drops that connection

    def connect(self) -> None:
        ray.init(address=self.config.ray, namespace=self.namespace, log_to_driver=True)
        log.info("joined the Ray cluster at %s (namespace %s): %s", self.config.ray, self.namespace,
                 ray.cluster_resources())

    def start(self) -> None:
        model = self.config.model or EMBEDDED_MODEL
        decode = self._decode_resources()
        # each actor's host says where its process listens (a free port of its node), hence no address here
        for name in self.engines:
            self.hosts[name] = self._actor(name, decode).remote(name, "decode_gpu.service.server",
                                                                engine_config(self.config, model, ""), self.secret)
        kv_type = self.config.kv_type if self.config.kv_type != "auto" else "q8_0"  # the handoff crosses hosts
        cpus = self.config.ray_prefill_cpus or self.config.threads_per_worker or 1
        threads = self.config.threads_per_worker or max(1, int(cpus))
        for name in self.workers:  # no engine of its own: each job names its engine
            worker = worker_config(self.config, model, name, "", "", kv_type, threads)
            self.hosts[name] = self._actor(name, {"num_cpus": cpus}).remote(name, "prefill_cpu.worker", worker,
                                                                            self.secret)
        log.info("started %d decode engine and %d prefill worker actors (decode: %s each; prefill: %s CPUs, %d "
                 "threads, KV %s)", len(self.engines), len(self.workers), decode, cpus, threads, kv_type)

    def _decode_resources(self) -> dict:
        resource = self.config.ray_decode_resource
        return {"num_cpus": 0, "num_gpus": 1} if resource == "GPU" else {"num_cpus": 0, "resources": {resource: 1}}

    def _actor(self, name: str, resources: dict):
        return ray.remote(ProcessHost).options(name=name, max_restarts=-1, max_concurrency=8, **resources)

    async def resolve(self, name: str) -> str:
        """Where `name` listens now; LookupError while Ray cannot say (restarting, no node has the resources)."""
        try:
            return await asyncio.wait_for(self.hosts[name].ready.remote(READY_TIMEOUT_S), READY_TIMEOUT_S + 5)
        except (TimeoutError, ray.exceptions.RayError) as err:
            raise LookupError(f"{name} is not ready in the Ray cluster: {type(err).__name__}") from None

    async def watch(self, name: str) -> None:
        """Forever: wait for the actor's process to end (or the actor to die), tell the gateway, wait for its
        successor to be ready."""
        while True:
            try:
                code = await self.hosts[name].wait_stopped.remote()
                reason = f"{name}'s process exited (code {code}) on its Ray node; Ray restarts it"
            except ray.exceptions.RayError as err:
                reason = f"{name}'s Ray actor died ({type(err).__name__}); Ray restarts it"
            log.error("%s", reason)
            self.on_down(name, reason)
            await self._until_ready(name)

    async def _until_ready(self, name: str) -> None:
        while True:
            try:
                await self.resolve(name)
                return
            except LookupError:
                await asyncio.sleep(RETRY_S)

    def restart(self, name: str) -> bool:
        """A stuck worker: kill its actor (and with it the process); Ray starts a new one."""
        ray.kill(self.hosts[name], no_restart=False)
        return True

    async def stop(self) -> None:
        """Workers first: an engine stopping under a prefill would fail it for nothing."""
        for names in (self.workers, self.engines):
            stops = [self.hosts[name].stop.remote() for name in names if name in self.hosts]
            try:
                await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("some actors did not stop in %.0f s; killing them", STOP_TIMEOUT_S)
        for host in self.hosts.values():
            ray.kill(host, no_restart=True)
        ray.shutdown()
        log.info("stopped every actor; left the Ray cluster")
