"""OpenTelemetry traces of requests, exported over OTLP (optional: `pip install -e '.[tracing]'`).

One trace per request, made when it ends from the times the gateway recorded (RequestRecord.marks): a root
span `request` and one child per phase: `queue` (waiting for a prefill worker), `prefill` (llama.cpp over the
prompt, and the KV handoff sent), `engine` (the handoff's import until the first token reaches the gateway)
and `decode` (the first token to the last). So a slow request's trace shows where its time went. Nothing here is
imported unless `otlp_traces_endpoint` is set.
"""

from __future__ import annotations

import logging

log = logging.getLogger("edge.observe.tracing")
PHASES = (("queue", "created", "prefill_started"), ("prefill", "prefill_started", "handed_off"),
          ("engine", "handed_off", "first_token"), ("decode", "first_token", "end"))


class RequestTracer:
    """A gateway observer: each RequestRecord becomes one trace (records of refused requests too, as a root span
    alone)."""

    def __init__(self, endpoint: str = "", exporter=None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            raise ValueError("otlp_traces_endpoint needs OpenTelemetry: pip install -e '.[tracing]'") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": "edge-llm"}))
        if exporter is None:  # OTLP over HTTP; a batch processor exports from its own thread, off the event loop
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
            log.info("request traces go to %s (OTLP over HTTP)", endpoint)
        else:  # tests: an in-memory exporter, exported at once
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("edge.core.gateway")

    def __call__(self, record) -> None:
        from opentelemetry import trace
        marks = {**dict(record.marks), "end": record.time}
        start = marks.get("created", record.time)
        root = self.tracer.start_span("request", start_time=_ns(start), attributes=_attributes(record))
        if record.status in ("failed", "rejected"):
            root.set_status(trace.Status(trace.StatusCode.ERROR, record.finish_reason))
        context = trace.set_span_in_context(root)
        for name, begin, end in PHASES:
            if begin in marks and end in marks:
                self.tracer.start_span(name, context=context, start_time=_ns(marks[begin])).end(_ns(marks[end]))
        root.end(_ns(record.time))

    def close(self) -> None:
        self.provider.shutdown()  # flushes what the batch processor holds


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _attributes(record) -> dict:
    values = {"edge.request_id": record.request_id, "edge.observe.status_board": record.status,
              "edge.finish_reason": record.finish_reason, "http.response.status_code": record.http_status,
              "edge.client_class": record.client_class, "edge.model": record.model, "edge.kind": record.kind,
              "http.route": record.route,
              "edge.tier": record.tier, "edge.priority": record.priority, "gen_ai.usage.input_tokens":
              record.prompt_tokens, "gen_ai.usage.output_tokens": record.completion_tokens,
              "edge.key_id": record.key_id or "", "edge.degradation": list(record.degradation)}
    return {key: value for key, value in values.items() if value not in ("", None)}
