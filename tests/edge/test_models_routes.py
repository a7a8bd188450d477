"""The routes with [[models]] (issue 45), on an aiohttp test server with fake stacks (no processes): `model` picks
the model's stack on every route (loading it first), a key limited to model A gets for model B the very 404 an
unknown model gets on every route and does not see it in /v1/models, the operator's load and unload are admin-only,
and a body without a model, or with a bad keep_alive, is a 400."""

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_gateway import fake_gateway

from edge.http.routes import add_routes
from edge.models.registry import LOADED, UNLOADED, ModelRegistry
from edge.models.spec import FOREVER, ModelSpec
from edge.state import GATEWAY, MODELS
from policies.schema import ApiKeyRule, ClientClass, ModelLimits, Policy

CHAT = {"messages": [{"role": "user", "content": "x"}]}
ROUTES = [  # (path, body without its model)
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/responses", {"input": "x"}),
    ("/v1/messages", {**CHAT, "max_tokens": 4}),
    ("/v1/messages/count_tokens", CHAT),
    ("/v1/embeddings", {"input": "x"}),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}),
    ("/tokenize", {"prompt": "x"}),
    ("/detokenize", {"tokens": [1]}),
]
POLICY = Policy("test", classes={"default": ClientClass("default"), "only_a": ClientClass("only_a", models=("a",))},
                keys={"ka": ApiKeyRule("ka", "default", models=("a",)), "ca": ApiKeyRule("ca", "only_a"),
                      "all": ApiKeyRule("all", "default"), "admin": ApiKeyRule("admin", "default", admin=True),
                      "rl": ApiKeyRule("rl", "default", model_limits={"b": ModelLimits(requests_per_minute=1)})})


class FakeStack:
    def __init__(self, spec: ModelSpec, started: list, enforcer) -> None:
        self.gateway, _ = fake_gateway(POLICY)  # no worker ready: a request it admits is answered 503
        self.gateway.model_name = spec.name
        self.gateway.enforcer = enforcer  # the app's one, as edge.app's stacks share it
        self.started = started
        self.name = spec.name

    async def start(self) -> None:
        self.started.append(self.name)

    async def stop(self) -> None:
        return None

    def in_flight(self) -> int:
        return 0

    def memory(self) -> dict:
        return {"rss": 1, "pss": 1}


def serve(scenario):
    async def run():
        started: list[str] = []
        app = web.Application()
        app[GATEWAY], refused = fake_gateway(POLICY)
        specs = tuple(ModelSpec(name, f"/nowhere/{name}.gguf", (), FOREVER) for name in ("a", "b"))
        app[MODELS] = ModelRegistry(specs, lambda spec: FakeStack(spec, started, app[GATEWAY].enforcer))
        add_routes(app)
        async with TestClient(TestServer(app)) as client:
            return await scenario(client, app), started, refused
    return asyncio.run(run())


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def answer(response) -> tuple[int, dict]:
    return response.status, await response.json()


def test_a_key_limited_to_a_gets_the_unknown_models_404_for_b_on_every_route():
    async def scenario(client, app):
        out = []
        for key in ("ka", "ca"):  # limited on the key, or by its class
            for path, body in ROUTES:
                other = await answer(await client.post(path, json={"model": "b", **body}, headers=auth(key)))
                unknown = await answer(await client.post(path, json={"model": "zz", **body}, headers=auth(key)))
                out.append((key, path, other, unknown))
            card = await answer(await client.get("/v1/models/b", headers=auth(key)))
            listed = await answer(await client.get("/v1/models", headers=auth(key)))
            out.append((key, "cards", card, listed))
        return out
    out, started, _ = serve(scenario)
    for key, path, other, unknown in out:
        if path == "cards":
            assert other[0] == 404 and other[1]["error"]["code"] == "model_not_found"
            assert [m["id"] for m in unknown[1]["data"]] == ["a"], key
            continue
        assert other[0] == unknown[0] == 404, (key, path, other)
        assert str(other[1]).replace("'b'", "'zz'") == str(unknown[1]), (key, path)  # the same body: no leak
        assert "available: a" in str(other[1]) and ", b" not in str(other[1]), (key, path)  # only what it may use
    assert started == []  # nothing was loaded for a model the key may not use


def test_model_picks_the_models_stack_on_every_route_and_loads_it_first():
    async def scenario(client, app):
        out = []
        for path, body in ROUTES:
            status, sent = await answer(await client.post(path, json={"model": "a", **body}, headers=auth("ka")))
            out.append((path, status, sent))
        return out, app[MODELS].slots["a"].state, app[MODELS].slots["b"].state
    (out, a_state, b_state), started, _ = serve(scenario)
    assert started == ["a"] and a_state == LOADED and b_state == UNLOADED
    for path, status, body in out:  # a's gateway answered: no worker of its is ready, or it checks the request
        assert status != 404, (path, status, body)
        assert status in (200, 400, 503), (path, status, body)


def test_models_lists_every_model_a_key_may_use_with_state_and_memory():
    async def scenario(client, app):
        await client.post("/v1/chat/completions", json={"model": "b", **CHAT}, headers=auth("all"))
        return await answer(await client.get("/v1/models", headers=auth("all")))
    (status, listed), _, _ = serve(scenario)
    cards = {m["id"]: m for m in listed["data"]}
    assert status == 200 and set(cards) == {"a", "b"}
    assert cards["a"]["state"] == UNLOADED and cards["b"]["state"] == LOADED
    assert cards["b"]["memory"]["measured"] == {"rss": 1, "pss": 1} and cards["a"]["memory"]["measured"] is None
    assert cards["b"]["loaded_at"] and cards["a"]["loaded_at"] is None


def test_load_and_unload_are_admin_only():
    async def scenario(client, app):
        out = [await answer(await client.post("/v1/models/a/load")),
               await answer(await client.post("/v1/models/a/load", headers=auth("all"))),
               await answer(await client.post("/v1/models/a/unload", headers=auth("ka"))),
               await answer(await client.post("/v1/models/nope/load", headers=auth("admin"))),
               await answer(await client.post("/v1/models/a/load", headers=auth("admin")))]
        loaded = app[MODELS].slots["a"].state
        out.append(await answer(await client.post("/v1/models/a/unload", headers=auth("admin"))))
        return out, loaded, app[MODELS].slots["a"].state
    (out, loaded, after), started, _ = serve(scenario)
    assert [status for status, _ in out] == [401, 403, 403, 404, 200, 200]
    assert out[4][1]["state"] == LOADED and out[5][1]["state"] == UNLOADED
    assert loaded == LOADED and after == UNLOADED and started == ["a"]


def test_a_body_without_a_model_or_with_a_bad_keep_alive_is_a_400():
    async def scenario(client, app):
        return [await answer(await client.post("/v1/chat/completions", json=CHAT, headers=auth("all"))),
                await answer(await client.post("/v1/chat/completions", json={"model": "a", "keep_alive": "soon",
                                                                             **CHAT}, headers=auth("all")))]
    (missing, keep_alive), started, refused = serve(scenario)
    assert missing[0] == 400 and missing[1]["error"]["param"] == "model" and "a, b" in missing[1]["error"]["message"]
    assert keep_alive[0] == 400 and keep_alive[1]["error"]["param"] == "keep_alive"
    assert started == [] and [status for status, _ in refused] == [400, 400]  # heard by the app's observers


def test_the_status_page_shows_each_models_state_memory_and_load():
    async def scenario(client, app):
        await client.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=auth("all"))
        return await answer(await client.get("/status.json", headers=auth("admin")))
    (status, board), _, _ = serve(scenario)
    models = {m["name"]: m for m in board["models"]}
    assert status == 200 and set(models) == {"a", "b"}
    assert models["a"]["state"] == LOADED and models["a"]["memory"]["measured"] == {"rss": 1, "pss": 1}
    assert models["a"]["load"]["waiting"] == 0 and models["b"]["state"] == UNLOADED and models["b"]["load"] is None
    assert models["a"]["load"]["tier"] == "normal"  # the degradation tier its own load puts it in


def test_a_limit_on_a_model_is_a_429_naming_it_and_a_refused_request_loads_nothing():
    async def scenario(client, app):
        first = await answer(await client.post("/v1/chat/completions", json={"model": "b", **CHAT}, headers=auth("rl")))
        second = await answer(await client.post("/v1/chat/completions", json={"model": "b", **CHAT},
                                                headers=auth("rl")))  # b loaded: its gateway's decide refuses
        other = await answer(await client.post("/v1/chat/completions", json={"model": "a", **CHAT},
                                               headers=auth("rl")))
        await client.post("/v1/models/b/unload", headers=auth("admin"))
        before_load = await answer(await client.post("/v1/completions", json={"model": "b", "prompt": "x"},
                                                     headers=auth("rl")))  # b unloaded: refused before its load
        return first, second, other, before_load, app[MODELS].slots["b"].state
    (first, second, other, before_load, b_state), started, refused = serve(scenario)
    assert first[0] == 503  # admitted by the policy (its one request this minute), then no worker: 503
    for status, body in (second, before_load):
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and body["error"]["param"] == "model"
        assert "rate limit of 1 requests per minute on model 'b'" in body["error"]["message"]
    assert other[0] == 503  # its other model is not limited
    assert started == ["b", "a"] and b_state == UNLOADED  # the refused request did not load b again
    assert (429, "rate_limit_exceeded") in refused


def test_a_single_model_server_refuses_load_and_unload_and_lists_its_one_model():
    from edge.models.stack import ServedStack

    async def run():
        app = web.Application()
        app[GATEWAY], _ = fake_gateway()
        app[MODELS] = ModelRegistry.single(ModelSpec("m", "/nowhere/m.gguf", (), FOREVER, True),
                                           ServedStack(app[GATEWAY], None))
        add_routes(app)
        async with TestClient(TestServer(app)) as client:
            return (await answer(await client.post("/v1/models/m/unload")),
                    await answer(await client.get("/v1/models")))
    (status, body), (listed_status, listed) = asyncio.run(run())
    assert status == 400 and body["error"]["code"] == "model_not_unloadable"
    assert listed_status == 200 and [m["id"] for m in listed["data"]] == ["m"]
