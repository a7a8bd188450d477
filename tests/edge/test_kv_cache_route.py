"""DELETE /v1/kv_cache: admin only; the salt a tenant's requests get is the one every worker is asked to forget."""

import asyncio
from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_gateway import fake_gateway, keyed

from contracts.framing import unpack
from contracts.messages import ForgetSalt, SaltForgotten
from edge.core.lifecycle import InFlightRegistry
from edge.core.prefill_pool import PrefillPool
from edge.http.routes import add_routes
from edge.state import GATEWAY

ADMIN, USER = "admin-key-0123", "user-key-0123"


def _delete(path: str, key: str | None):
    gateway, _ = fake_gateway(keyed({ADMIN: True, USER: False}))
    asked = []

    async def forget_salt(salt):
        asked.append(salt)
        return {"prefill-0": SaltForgotten(salt, 2, 1), "prefill-1": None}
    gateway.pool.forget_salt = forget_salt
    app = web.Application()
    app[GATEWAY] = gateway
    add_routes(app)

    async def run():
        async with TestClient(TestServer(app)) as client:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = await client.delete(path, headers=headers)
            return response.status, await response.json()
    status, body = asyncio.run(run())
    return status, body, asked, gateway


def test_only_an_admin_key_may_delete():
    assert _delete(f"/v1/kv_cache?key={USER}", None)[0] == 401
    assert _delete(f"/v1/kv_cache?key={USER}", "not-a-key")[0] == 401
    assert _delete(f"/v1/kv_cache?key={USER}", USER)[0] == 403
    assert _delete("/v1/kv_cache?key=unknown", ADMIN)[0] == 404
    assert _delete("/v1/kv_cache", ADMIN)[0] == 400
    assert _delete(f"/v1/kv_cache?key={USER}&tenant=t", ADMIN)[0] == 400


def test_the_tenant_s_own_salt_is_forgotten_on_every_worker():
    status, body, asked, gateway = _delete(f"/v1/kv_cache?key={USER}", ADMIN)
    as_requested = gateway.cache_salt(SimpleNamespace(headers={"Authorization": f"Bearer {USER}"}),
                                      SimpleNamespace(cache_salt=""))
    assert status == 200 and asked == [as_requested] and as_requested
    assert body == {"deleted": {"entries": 2, "files": 1}, "shared": False,
                    "workers": {"prefill-0": {"entries": 2, "files": 1}, "prefill-1": None}}


class _Writer:
    def __init__(self):
        self.frames = []

    def write(self, data):
        self.frames.append(unpack(data[4:]))

    async def drain(self):
        pass

    def close(self):
        pass


def test_the_pool_asks_each_ready_worker_and_collects_its_answer():
    async def scenario():
        pool = PrefillPool({"w0": "unix:/x", "w1": "unix:/y", "w2": "unix:/z"}, InFlightRegistry(), queue_limit=4)
        for name in ("w0", "w1"):
            pool.workers[name].state, pool.workers[name].writer = "ready", _Writer()
        asking = asyncio.ensure_future(pool.forget_salt("s", timeout_s=0.5))
        await asyncio.sleep(0)  # the frames go out
        while not pool.workers["w1"].writer.frames:
            await asyncio.sleep(0.01)
        pool._on_message(pool.workers["w0"], SaltForgotten("s", 3, 2))  # w1 never answers
        answers = await asking
        return answers, [w.writer.frames for w in (pool.workers["w0"], pool.workers["w1"])]

    answers, frames = asyncio.run(scenario())
    assert answers == {"w0": SaltForgotten("s", 3, 2), "w1": None}  # w2 is not ready: not asked
    assert frames == [[ForgetSalt("s")], [ForgetSalt("s")]]
