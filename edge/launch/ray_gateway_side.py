"""The gateway's side of `edge serve --ray`: its prefill pool and engine group wired to the Ray actors."""

from __future__ import annotations

import logging

from contracts.tasks import spawn
from edge.config import ServeConfig
from edge.core.engine_client import EngineClient
from edge.core.engine_group import EngineGroup
from edge.core.lifecycle import InFlightRegistry
from edge.core.prefill_pool import PrefillPool
from edge.launch.ray_placement import CONNECT_TIMEOUT_S, RayPlacement

log = logging.getLogger("edge.cluster")


def ray_components(config: ServeConfig, registry: InFlightRegistry, secret: str):
    """(prefill pool, engine group, the app's cleanup context that starts and stops the actors). Joins the
    cluster now, so that a wrong address stops `edge serve` before it listens."""
    placement = RayPlacement(config, secret)
    placement.connect()
    key = secret.encode()
    pool = PrefillPool({name: "" for name in placement.workers}, registry, config.limits.prefill_queue_size, key,
                       config.worker_heartbeat_timeout_s)
    pool.resolve, pool.connect_timeout_s = placement.resolve, CONNECT_TIMEOUT_S
    clients = {name: EngineClient("", registry, key, name) for name in placement.engines}
    for name, client in clients.items():
        client.resolve = lambda name=name: placement.resolve(name)
        client.connect_timeout_s = CONNECT_TIMEOUT_S
    group = EngineGroup(clients, registry)
    pool.on_stuck = placement.restart

    def down(name: str, reason: str) -> None:
        if name in pool.workers:
            pool.drop(name, reason)
        else:
            clients[name].drop(reason)
    placement.on_down = down

    async def context(app):
        placement.start()
        watchers = [spawn(placement.watch(name), f"watching {name} through Ray", log) for name in placement.hosts]
        yield
        for watcher in watchers:
            watcher.cancel()
        await placement.stop()
    return pool, group, context
