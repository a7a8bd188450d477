"""OpenTelemetry request traces: a request's record becomes a root span and one child per phase, exported over
OTLP/HTTP to a collector (a fake one here, an aiohttp server reading the protobuf body); nothing is imported
without the setting."""

import subprocess
import sys
import threading

import pytest
from aiohttp import web

from edge.core.request_record import RequestRecord

pytest.importorskip("opentelemetry.sdk", reason="OpenTelemetry is the optional [tracing] extra")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from edge.observe.tracing import RequestTracer  # noqa: E402

T0 = 1_800_000_000.0


def _record(**fields) -> RequestRecord:
    values = dict(time=T0 + 2.0, request_id="chatcmpl-1", key_id="sha256:0123456789abcdef", client_class="default",
                  tenant=None, model="m", kind="chat", client="127.0.0.1", status="finished", finish_reason="stop",
                  http_status=200, prompt_tokens=12, completion_tokens=5, tier="normal",
                  marks=(("created", T0), ("prefill_started", T0 + 0.1), ("handed_off", T0 + 0.4),
                         ("first_token", T0 + 0.5)))
    return RequestRecord(**{**values, **fields})


def test_a_request_becomes_a_root_span_with_one_child_per_phase():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter=exporter)
    tracer(_record())
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"request", "queue", "prefill", "engine", "decode"}
    root = spans["request"]
    assert (root.start_time, root.end_time) == (int(T0 * 1e9), int((T0 + 2.0) * 1e9))
    assert root.attributes["edge.request_id"] == "chatcmpl-1" and root.attributes["gen_ai.usage.output_tokens"] == 5
    for name, (begin, end) in {"queue": (0, 0.1), "prefill": (0.1, 0.4), "engine": (0.4, 0.5),
                               "decode": (0.5, 2.0)}.items():
        span = spans[name]
        assert span.parent.span_id == root.context.span_id and span.context.trace_id == root.context.trace_id
        assert abs(span.start_time / 1e9 - (T0 + begin)) < 1e-3 and abs(span.end_time / 1e9 - (T0 + end)) < 1e-3
    tracer.close()


def test_a_refused_request_is_a_root_span_marked_as_an_error():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter=exporter)
    tracer(_record(request_id="", status="rejected", finish_reason="invalid_api_key", http_status=401, marks=()))
    (span,) = exporter.get_finished_spans()
    assert span.name == "request" and span.status.status_code.name == "ERROR"
    assert span.attributes["http.response.status_code"] == 401


def test_spans_reach_an_otlp_http_collector():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    received, ready = [], threading.Event()

    async def traces(request: web.Request) -> web.Response:
        received.append((request.content_type, await request.read()))
        return web.Response(status=200)

    def collector(port_box: list) -> None:
        import asyncio

        async def main():
            app = web.Application()
            app.router.add_post("/v1/traces", traces)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port_box.append(site._server.sockets[0].getsockname()[1])
            ready.set()
            while len(received) == 0:
                await asyncio.sleep(0.05)
            await runner.cleanup()
        asyncio.run(main())

    port: list = []
    thread = threading.Thread(target=collector, args=(port,), daemon=True)
    thread.start()
    assert ready.wait(10)
    tracer = RequestTracer(f"http://127.0.0.1:{port[0]}/v1/traces")
    tracer(_record())
    tracer.close()  # flushes the batch processor
    thread.join(10)
    content_type, body = received[0]
    assert content_type == "application/x-protobuf"
    message = ExportTraceServiceRequest.FromString(body)
    names = {span.name for rs in message.resource_spans for ss in rs.scope_spans for span in ss.spans}
    assert names == {"request", "queue", "prefill", "engine", "decode"}


def test_without_the_setting_opentelemetry_is_not_imported():
    code = ("import sys, edge.app, edge.cli, edge.core.gateway\n"
            "print(any(name.startswith('opentelemetry') for name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_a_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"pip install -e '\.\[tracing\]'"):
        RequestTracer("http://127.0.0.1:4318/v1/traces")
