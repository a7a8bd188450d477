"""Issue 48: a model this server does not serve, or one the policy's allowed_models leave out, is a 404 on every
route in each API's error shape, and the real clients raise NotFoundError for it (openai's models.retrieve and
chat, anthropic's messages.create), against the routes on an aiohttp test server."""

import asyncio

import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_gateway import fake_gateway

from edge.http.routes import add_routes
from edge.state import GATEWAY
from policies.schema import Filters, Policy

CHAT = {"messages": [{"role": "user", "content": "x"}]}
ROUTES = [  # (path, body without its model)
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}}}}),  # answered before the constraint is compiled
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/completions", {"prompt": ["x", "y"]}),
    ("/v1/responses", {"input": "x"}),
    ("/v1/messages", {**CHAT, "max_tokens": 4}),
    ("/v1/messages/count_tokens", CHAT),
    ("/v1/embeddings", {"input": "x"}),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}),
    ("/tokenize", {"prompt": "x"}),
]


def serve(scenario, policy: Policy | None = None):
    async def run():
        app = web.Application()
        app[GATEWAY], refused = fake_gateway(policy)
        add_routes(app)
        async with TestClient(TestServer(app)) as client:
            return await scenario(client), refused
    return asyncio.run(run())


@pytest.mark.parametrize(("model", "policy"), [("nope", None), ("m", Policy("t", Filters(allowed_models=("x",))))],
                         ids=["not served", "not allowed"])
def test_every_route_answers_404_in_its_apis_shape(model, policy):
    async def scenario(client):
        answers = []
        for path, body in ROUTES:
            response = await client.post(path, json={"model": model, **body})
            answers.append((path, response.status, await response.json()))
        card = await client.get(f"/v1/models/{model}")
        return answers, (card.status, await card.json())

    (answers, (card_status, card)), refused = serve(scenario, policy)
    for path, status, body in answers:
        assert status == 404, (path, status, body)
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["type"] == "not_found_error", path
        else:
            assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model", path
            assert repr(model) in body["error"]["message"], path
    assert card_status == 404 and card["error"]["code"] == "model_not_found"
    assert (404, "model_not_found") in refused


def test_the_openai_and_anthropic_clients_raise_not_found():
    async def scenario(client):
        base = str(client.make_url(""))
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
        raised = []
        for call in (lambda: oai.models.retrieve("nope"),
                     lambda: oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}]),
                     lambda: oai.completions.create(model="nope", prompt="x"),
                     lambda: oai.responses.create(model="nope", input="x"),
                     lambda: oai.embeddings.create(model="nope", input="x"),
                     lambda: claude.messages.create(model="nope", max_tokens=4,
                                                    messages=[{"role": "user", "content": "x"}])):
            try:
                await call()
            except (openai.APIStatusError, anthropic.APIStatusError) as err:
                raised.append(type(err))
        card = await oai.models.retrieve("m")  # the served model is found
        return raised, card.id

    (raised, served), _ = serve(scenario)
    assert raised == [openai.NotFoundError] * 5 + [anthropic.NotFoundError] and served == "m"
