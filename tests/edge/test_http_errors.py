"""Every error the HTTP layer answers has the OpenAI body {"error": {message, type, param, code}}: bad JSON,
aiohttp's own 404/405/413 and unexpected exceptions, which aiohttp alone would answer in plain text."""

import asyncio
import logging

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_gateway import fake_gateway, rejected_count

from edge.http.routes import add_routes
from edge.state import GATEWAY

REFUSALS = web.AppKey("refusals", list)


async def _broken(request: web.Request) -> web.Response:
    raise RuntimeError("boom")


async def _timing_out(request: web.Request) -> web.Response:
    raise TimeoutError


async def _read_body(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


def _app(**kwargs) -> web.Application:
    app = web.Application(**kwargs)
    app[GATEWAY], app[REFUSALS] = fake_gateway()
    add_routes(app)
    app.router.add_get("/broken", _broken)
    app.router.add_get("/timing-out", _timing_out)
    app.router.add_post("/read", _read_body)
    return app


def _call(method: str, path: str, app: web.Application | None = None, **kwargs):
    async def run():
        async with TestClient(TestServer(app or _app())) as client:
            response = await client.request(method, path, **kwargs)
            assert response.content_type == "application/json", await response.text()
            return response.status, response.headers, await response.json()
    return asyncio.run(run())


def _post_chat(data: bytes):
    return _call("POST", "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})


def test_deep_nesting_at_top_level_is_400_json():
    status, _, body = _post_chat(b"[" * 100_000 + b"]" * 100_000)
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    assert "nest" in body["error"]["message"]


def test_a_refused_request_is_counted_and_told_to_the_observers():
    app = _app()
    status, _, _ = _call("POST", "/v1/chat/completions", app=app, data=b"{not json",
                         headers={"Content-Type": "application/json"})
    assert status == 400
    assert rejected_count(app[GATEWAY], "invalid_json") == 1 and app[REFUSALS] == [(400, "invalid_json")]


def test_deep_nesting_inside_messages_is_400_json():
    data = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, body = _post_chat(data)
    assert (status, body["error"]["code"]) == (400, "invalid_json")


def test_integer_with_more_digits_than_python_parses_is_400_json():
    data = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": ' + b"7" * 5000 + b"}"
    status, _, body = _post_chat(data)
    assert (status, body["error"]["code"]) == (400, "invalid_json")


def test_lone_surrogate_escape_in_the_body_is_400_naming_the_field():
    status, _, body = _post_chat(b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}')
    assert status == 400
    assert (body["error"]["param"], body["error"]["code"]) == ("messages[0].content", "invalid_value")


def test_get_on_a_post_route_is_405_json_with_allow():
    status, headers, body = _call("GET", "/v1/chat/completions")
    assert (status, headers["Allow"]) == (405, "POST")
    assert body["error"]["code"] == "method_not_allowed" and "POST" in body["error"]["message"]


def test_unknown_path_is_404_json():
    status, _, body = _call("GET", "/v1/nope")
    assert status == 404
    assert body["error"]["code"] == "not_found" and "/v1/chat/completions" in body["error"]["message"]


def test_body_over_client_max_size_is_413_json():
    status, _, body = _call("POST", "/read", app=_app(client_max_size=64), data=b"x" * 1000)
    assert (status, body["error"]["code"]) == (413, "body_too_large")


def test_unexpected_exception_is_500_json_and_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="edge.http"):
        status, _, body = _call("GET", "/broken")
    assert (status, body["error"]["type"], body["error"]["code"]) == (500, "server_error", "internal_error")
    assert "boom" not in body["error"]["message"]  # details stay in the log
    assert any(record.exc_info and "boom" in str(record.exc_info[1]) for record in caplog.records)


def test_handler_timeout_is_504_json():
    status, _, body = _call("GET", "/timing-out")
    assert (status, body["error"]["type"], body["error"]["code"]) == (504, "server_error", "timeout")
