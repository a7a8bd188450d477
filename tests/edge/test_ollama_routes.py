"""Ollama's /api/... routes on an aiohttp test server over a real gateway on fakes (no worker ready: a request that
passes every check is answered 503): the key, the model check (404, also for a model the policy's allowed_models
leave out, and the model left out of /api/tags), the refusals of model management, load requests, and every error
in Ollama's shape, counted as the gateway counts refusals (edge/http/ollama.py)."""

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_gateway import fake_gateway, keyed, rejected_count

from edge.http.routes import add_routes
from edge.state import GATEWAY
from policies.schema import Filters, Policy

KEY = {"Authorization": "Bearer k"}
HI = [{"role": "user", "content": "Hi"}]


def serve(scenario, policy: Policy | None = None):
    async def run():
        app = web.Application()
        app[GATEWAY], refused = fake_gateway(policy)
        add_routes(app)
        async with TestClient(TestServer(app)) as client:
            return await scenario(client, app[GATEWAY]), refused
    return asyncio.run(run())


async def answer(response) -> tuple[int, dict]:
    return response.status, await response.json()


def test_version_needs_no_key_and_the_rest_do():
    async def scenario(client, gateway):
        out = [await answer(await client.get("/api/version"))]
        for method, path, body in (("GET", "/api/tags", None), ("GET", "/api/ps", None),
                                   ("POST", "/api/show", {"model": "m"}), ("POST", "/api/chat", {"model": "m"}),
                                   ("POST", "/api/generate", {"model": "m", "prompt": "x"}),
                                   ("POST", "/api/embed", {"model": "m", "input": "x"}),
                                   ("POST", "/api/pull", {"model": "m"})):
            out.append(await answer(await client.request(method, path, json=body)))
        return out
    (version, *denied), _ = serve(scenario, keyed({"k": False}))
    assert version == (200, {"version": "0.13.0"})
    assert all(status == 401 and set(body) == {"error"} and "API key" in body["error"] for status, body in denied)


def test_tags_and_show_describe_the_served_gguf():
    async def scenario(client, gateway):
        return (await answer(await client.get("/api/tags", headers=KEY)),
                await answer(await client.post("/api/show", json={"name": "m:latest"}, headers=KEY)))
    ((status, tags), (shown_status, shown)), _ = serve(scenario, keyed({"k": False}))
    assert status == 200 and [m["name"] for m in tags["models"]] == ["m:latest"]
    assert tags["models"][0]["details"]["family"] == "llama" and tags["models"][0]["size"] > 0
    assert shown_status == 200 and shown["capabilities"] == ["completion", "tools"]
    assert shown["model_info"]["general.architecture"] == "llama" and "general.name" not in shown["model_info"]


@pytest.mark.parametrize(("model", "policy"), [("nope", None), ("m", Policy("t", Filters(allowed_models=("x",))))],
                         ids=["not served", "not allowed"])
def test_a_model_not_served_or_not_allowed_is_a_404_everywhere(model, policy):
    async def scenario(client, gateway):
        out = []
        for path, body in (("/api/chat", {"messages": HI}), ("/api/chat", {"messages": []}),
                           ("/api/generate", {"prompt": "x"}), ("/api/show", {}), ("/api/embed", {"input": "x"}),
                           ("/api/embeddings", {"prompt": "x"})):
            out.append(await answer(await client.post(path, json={"model": model, **body})))
        tags = await answer(await client.get("/api/tags"))
        return out, tags, rejected_count(gateway, "model_not_found")
    (answers, tags, counted), refused = serve(scenario, policy)
    assert all(status == 404 and set(body) == {"error"} and repr(model) in body["error"] for status, body in answers)
    assert counted == len(answers) and refused == [(404, "model_not_found")] * len(answers)
    assert tags == (200, {"models": [] if policy else [tags[1]["models"][0]]})


def test_a_served_model_passes_every_check_and_waits_for_its_workers():
    async def scenario(client, gateway):
        return [await answer(await client.post(path, json={"model": "m:latest", **body}))
                for path, body in (("/api/chat", {"messages": HI}), ("/api/generate", {"prompt": "x"}),
                                   ("/api/embed", {"input": ["a", "b"]}))]
    answers, refused = serve(scenario)
    assert all(status == 503 and set(body) == {"error"} for status, body in answers)  # admission's own answer
    assert [status for status, _ in refused] == [503] * 3


def test_bad_bodies_are_400s_naming_the_field():
    async def scenario(client, gateway):
        out = []
        for path, body in (("/api/chat", {"model": "m", "messages": HI, "options": {"num_predict": 0}}),
                           ("/api/chat", {"model": "m", "messages": "hi"}),
                           ("/api/generate", {"model": "m", "prompt": "x", "suffix": "y"}),
                           ("/api/embed", {"model": "m", "input": 5}),
                           ("/api/embed", {"model": "m", "input": "x", "dimensions": 3}),
                           ("/api/show", {}), ("/api/chat", {"messages": HI}),
                           ("/api/chat", {"model": "m", "messages": HI, "keep_alive": "forever"})):
            out.append(await answer(await client.post(path, json=body)))
        out.append(await answer(await client.post("/api/chat", data=b"{not json")))
        return out
    answers, _ = serve(scenario)
    words = ["num_predict", "messages", "suffix", "input", "dimensions", "model", "model", "keep_alive", "JSON"]
    assert [status for status, _ in answers] == [400] * len(words)
    assert [next(w for w in words if w in body["error"]) for _, body in answers] == words


def test_load_requests_load_and_keep_alive_zero_is_refused():
    async def scenario(client, gateway):
        return [await answer(await client.post(path, json=body)) for path, body in (
            ("/api/chat", {"model": "m:latest", "messages": []}), ("/api/generate", {"model": "m"}),
            ("/api/embed", {"model": "m", "input": []}), ("/api/chat", {"model": "m", "keep_alive": 0}))]
    (chat, generate, embed, unload), _ = serve(scenario)
    assert chat[0] == 200 and chat[1]["done_reason"] == "load" and chat[1]["message"] == {"role": "assistant",
                                                                                          "content": ""}
    assert chat[1]["model"] == "m:latest" and chat[1]["done"] is True
    assert generate[0] == 200 and generate[1]["response"] == "" and generate[1]["done_reason"] == "load"
    assert embed == (200, {"model": "m", "embeddings": []})
    assert unload[0] == 400 and "unloaded" in unload[1]["error"]


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/api/pull", {"model": "llama3"}), ("POST", "/api/push", {"model": "m"}),
    ("POST", "/api/create", {"model": "x", "from": "m"}), ("POST", "/api/copy", {"source": "m", "destination": "x"}),
    ("DELETE", "/api/delete", {"model": "m"}), ("HEAD", "/api/blobs/sha256:ab", None),
    ("POST", "/api/blobs/sha256:ab", None)])
def test_model_management_is_refused(method, path, body):
    async def scenario(client, gateway):
        response = await client.request(method, path, json=body)
        return response.status, (await response.json() if method != "HEAD" else {"error": "config"})
    (status, answer_body), refused = serve(scenario)
    assert status == 403 and "config" in answer_body["error"] and refused == [(403, "model_management_unsupported")]


def test_aiohttp_own_errors_under_api_answer_in_ollamas_shape():
    async def scenario(client, gateway):
        unknown = await client.get("/api/nothing_here", headers=KEY)
        wrong_method = await client.get("/api/chat", headers=KEY)
        openai = await client.get("/v1/nothing_here", headers=KEY)
        return [(r.status, await r.json()) for r in (unknown, wrong_method, openai)]
    (unknown, wrong_method, openai), _ = serve(scenario)
    assert unknown[0] == 404 and set(unknown[1]) == {"error"} and "/api/nothing_here" in unknown[1]["error"]
    assert wrong_method[0] == 405 and set(wrong_method[1]) == {"error"} and "POST" in wrong_method[1]["error"]
    assert openai[0] == 404 and set(openai[1]["error"]) >= {"message", "code"}  # the OpenAI routes keep theirs


class FakeStack:
    """A model's stack whose gateway is a real one on fakes (no worker: it answers 503 once admitted)."""

    def __init__(self, name: str, started: list[str], enforcer) -> None:
        self.gateway, _ = fake_gateway()
        self.gateway.model_name, self.name, self.started = name, name, started
        self.gateway.enforcer = enforcer

    async def start(self) -> None:
        self.started.append(self.name)

    async def stop(self) -> None:
        self.started.remove(self.name)

    def in_flight(self) -> int:
        return 0

    def memory(self) -> dict:
        return {"rss": 2048, "pss": 1024}


def serve_several(scenario, policy: Policy | None = None):
    """Two configured models, `chat` and `code`, behind a front gateway (edge.models.app), none loaded at start; the
    models' gateways share the front's enforcer, as edge.app's do."""
    from edge.models.registry import ModelRegistry
    from edge.models.spec import ModelSpec
    from edge.state import MODELS

    async def run():
        started: list[str] = []
        app = web.Application()
        app[GATEWAY], refused = fake_gateway(policy)
        app[GATEWAY].model_name = ""
        app[MODELS] = ModelRegistry((ModelSpec("chat", None), ModelSpec("code", None, keep_alive_s=60)),
                                    lambda spec: FakeStack(spec.name, started, app[GATEWAY].enforcer))
        add_routes(app)
        async with TestClient(TestServer(app)) as client:
            return await scenario(client, app[MODELS], started), refused
    return asyncio.run(run())


def test_several_models_listed_loaded_on_demand_and_unloaded_by_keep_alive_zero():
    async def scenario(client, registry, started):
        tags = await answer(await client.get("/api/tags"))
        before = await answer(await client.get("/api/ps"))
        chat = await answer(await client.post("/api/chat", json={"model": "code:latest", "messages": HI}))
        after = await answer(await client.get("/api/ps"))
        loaded = list(started)
        unload = await answer(await client.post("/api/generate", json={"model": "code", "keep_alive": 0}))
        unloading = registry.slots["code"].task  # the unload is a task of the registry's: awaited, not polled
        await unloading
        load = await answer(await client.post("/api/chat", json={"model": "chat", "messages": []}))
        return tags, before, chat, after, loaded, unload, list(started), load
    (tags, before, chat, after, loaded, unload, left, load), _ = serve_several(scenario)
    assert [m["name"] for m in tags[1]["models"]] == ["chat:latest", "code:latest"]  # loaded or not
    assert before == (200, {"models": []})
    assert chat[0] == 503 and loaded == ["code"]  # loaded for the request, then its gateway answered (no worker)
    assert [(m["name"], m["size"]) for m in after[1]["models"]] == [("code:latest", 1024)]
    assert after[1]["models"][0]["expires_at"] < "2100"  # its keep_alive (60 s) from the answer's end
    assert unload[0] == 200 and unload[1]["done_reason"] == "unload" and left == ["chat"]
    assert load[0] == 200 and load[1]["done_reason"] == "load"


def test_a_key_limited_to_one_model_gets_the_unknown_models_404_for_the_other_on_every_ollama_route():
    """With several models and a key that may use `chat` only: `code` answers as a model that does not exist (the same
    404 body as for "zz") on show, chat, generate, embed and embeddings, plain and as a load request, nothing loads for
    it, and /api/tags and /api/ps list `chat` alone for that key."""
    from policies.schema import ApiKeyRule

    policy = Policy("test", keys={"kc": ApiKeyRule("kc", "default", models=("chat",)), "all": ApiKeyRule("all", "default")})
    limited = {"Authorization": "Bearer kc"}
    bodies = (("/api/show", {}), ("/api/chat", {"messages": HI}), ("/api/chat", {"messages": []}),
              ("/api/generate", {"prompt": "x"}), ("/api/generate", {}), ("/api/embed", {"input": "x"}),
              ("/api/embeddings", {"prompt": "x"}))

    async def scenario(client, registry, started):
        out = []
        for path, body in bodies:
            other = await answer(await client.post(path, json={"model": "code", **body}, headers=limited))
            unknown = await answer(await client.post(path, json={"model": "zz", **body}, headers=limited))
            out.append((path, other, unknown))
        loaded_before = list(started)
        await client.post("/api/chat", json={"model": "code", "messages": []}, headers={"Authorization": "Bearer all"})
        await client.post("/api/chat", json={"model": "chat", "messages": []}, headers=limited)
        lists = [await answer(await client.get(path, headers=headers)) for path in ("/api/tags", "/api/ps")
                 for headers in (limited, {"Authorization": "Bearer all"})]
        return out, loaded_before, lists
    (out, loaded_before, (tags, all_tags, ps, all_ps)), refused = serve_several(scenario, policy)
    for path, other, unknown in out:
        assert other[0] == unknown[0] == 404, (path, other)
        assert str(other[1]).replace("'code'", "'zz'") == str(unknown[1]), path  # the same body: no leak
        assert "code" not in str(other[1]).replace("'code'", ""), path  # not named among what it may use
    assert loaded_before == []  # nothing loaded for a model the key may not use
    assert [m["name"] for m in tags[1]["models"]] == ["chat:latest"]
    assert [m["name"] for m in all_tags[1]["models"]] == ["chat:latest", "code:latest"]
    assert [m["name"] for m in ps[1]["models"]] == ["chat:latest"]  # code is loaded, but not this key's
    assert sorted(m["name"] for m in all_ps[1]["models"]) == ["chat:latest", "code:latest"]
    assert refused.count((404, "model_not_found")) == 2 * len(bodies)
