"""The gateway's side of `edge serve --ray`: its prefill pool and engine group wired to the Ray actors."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from contracts.messages import Recompute
from contracts.tasks import spawn
from edge.config import ServeConfig
from edge.core.engine_client import EngineClient
from edge.core.engine_group import EngineGroup
from edge.core.lifecycle import InFlightRegistry
from edge.core.prefill_pool import PrefillPool
from edge.launch.ray_placement import CONNECT_TIMEOUT_S, RayPlacement

log = logging.getLogger("edge.cluster")


def ray_components(config: ServeConfig, registry: InFlightRegistry, secret: str,
                   on_recompute: Callable[[Recompute, EngineClient], None]):
    """(prefill pool, engine group, the app's cleanup context that starts and stops the actors). Joins the
    cluster now, so that a wrong address stops `edge serve` before it listens. on_recompute: the gateway's."""

    def down(name: str, reason: str) -> None:
        """An actor or its process died: drop the connection to it now (the watchers call this once the app runs,
        after the pool and the clients below exist)."""
        if name in pool.workers:
            pool.drop(name, reason)
        else:
            clients[name].drop(reason)

    placement = RayPlacement(config, secret, on_down=down)
    placement.connect()
    key = secret.encode()
    clients = {name: EngineClient("", registry, key, name, on_recompute=on_recompute,
                                  resolve=functools.partial(placement.resolve, name),
                                  connect_timeout_s=CONNECT_TIMEOUT_S, sole=False)
               for name in placement.engines}
    group = EngineGroup(clients, registry)
    pool = PrefillPool({name: "" for name in placement.workers}, registry, config.limits.prefill_queue_size, key,
                       config.worker_heartbeat_timeout_s, on_best_priority=group.prefill_priority_changed,
                       on_backlog=group.prefill_backlog_changed, on_stuck=placement.restart,
                       choose_engine=group.choose, resolve=placement.resolve, connect_timeout_s=CONNECT_TIMEOUT_S)

    async def context(app):
        placement.start()
        watchers = [spawn(placement.watch(name), f"watching {name} through Ray", log) for name in placement.hosts]
        yield
        for watcher in watchers:
            watcher.cancel()
        await placement.stop()
    return pool, group, context
