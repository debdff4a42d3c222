"""OpenTelemetry traces (`--otlp-traces-endpoint`; off by default).

This module is imported only when tracing is on, so a gateway without it
loads no OpenTelemetry code and pays nothing per request. The exporter is
the official OTLP one; its protocol comes from the standard
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (`grpc`, the default, or
`http/protobuf`), as vLLM chooses it. An `http/protobuf` endpoint given
without a path gets the standard `/v1/traces`. The service name is
`npu-gateway` unless `OTEL_SERVICE_NAME` says otherwise.

One SERVER span per HTTP request (a W3C `traceparent` from the client makes
it a child of the client's span), started when the request comes in so that
its context can be sent upstream. Its children are recorded when the
response is over, from the times the generation core noted on
`scope["state"]` (no span object is touched on the request path):

- `gateway.admission`: the key's limits, the queue wait for an engine slot
  or a node's acceptance;
- `gen_ai.engine` (a local engine) or `gen_ai.upstream` (a node, CLIENT
  kind): admission done to the last token;
- `gateway.stream`: the response to the client, from its status line.

Attributes follow the GenAI semantic conventions where they exist
(gen_ai.request.model, gen_ai.response.model, gen_ai.usage.*,
gen_ai.response.finish_reasons) and vLLM's latency names
(gen_ai.latency.*). The key's name is `npugw.key_name`; the key never is.

Upstream nodes get the request span's `traceparent` (their spans are its
children); see `server.ask.forwarded`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_PROPAGATOR = TraceContextTextMapPropagator()

# the GenAI operation of each endpoint (gen_ai.operation.name)
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
    "/generate": "text_completion",
    "/generate_stream": "text_completion",
}


def make_exporter(endpoint: str, protocol: str | None = None) -> SpanExporter:
    protocol = (protocol or os.environ.get(PROTOCOL_ENV) or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        if urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: use grpc or http/protobuf")


class Tracing:
    """The tracer of one gateway process: `start()` in the serving process
    (the batch exporter runs a thread, which a fork would not carry),
    `stop()` flushes what is left."""

    def __init__(self, endpoint: str, exporter: SpanExporter | None = None) -> None:
        self.endpoint = endpoint
        self._exporter = exporter
        self.provider: TracerProvider | None = None
        self.tracer: trace.Tracer | None = None

    def start(self) -> None:
        exporter = self._exporter or make_exporter(self.endpoint)
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "npu-gateway")})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("npu-gateway")

    def stop(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()  # exports what is queued
            self.provider = None
            self.tracer = None

    def begin(self, scope: Mapping[str, Any], headers: dict[bytes, bytes], state: dict[str, Any]) -> Span | None:
        """The request's span, and the headers that carry it upstream
        (`state["trace_headers"]`)."""
        tracer = self.tracer
        if tracer is None:
            return None
        carrier = {}
        tp = headers.get(b"traceparent")
        if tp is not None:
            carrier["traceparent"] = tp.decode("latin-1")
            ts = headers.get(b"tracestate")
            if ts is not None:
                carrier["tracestate"] = ts.decode("latin-1")
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        span = tracer.start_span(
            f"{scope['method']} {scope['path']}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        )
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        state["trace_headers"] = tuple(out.items())
        return span

    def end(
        self,
        span: Span,
        scope: Mapping[str, Any],
        state: dict[str, Any],
        rec: dict[str, Any] | None,
        status: int,
        start_ns: int,
        start: float,
        end: float,
    ) -> None:
        """Record the children from the noted times, then end the request's
        span. `rec`: the access log's record, when it was built."""
        tracer = self.tracer
        if tracer is None:
            return

        def ns(t: float) -> int:
            return start_ns + int((t - start) * 1e9)

        ctx = trace.set_span_in_context(span)
        model = state.get("model")
        target = state.get("target")
        t_admit = state.get("t_admit")
        t_admitted = state.get("t_admitted")
        t_first = state.get("t_first")
        t_done = state.get("t_done") or end
        t_response = state.get("t_response")
        if t_admit is not None:
            adm = tracer.start_span("gateway.admission", context=ctx, start_time=ns(t_admit))
            if t_admitted is None:
                adm.set_status(Status(StatusCode.ERROR, f"refused: {status}"))
            else:
                adm.set_attribute("gen_ai.latency.time_in_queue", t_admitted - t_admit)
            adm.end(end_time=ns(t_admitted if t_admitted is not None else end))
        if t_admitted is not None:
            relayed = bool(state.get("relayed"))
            work = tracer.start_span(
                "gen_ai.upstream" if relayed else "gen_ai.engine",
                context=ctx,
                kind=SpanKind.CLIENT if relayed else SpanKind.INTERNAL,
                start_time=ns(t_admitted),
            )
            if target is not None:
                work.set_attribute("gen_ai.response.model", target)
            if t_first is not None:
                # from the engine's (or node's) view: waiting + prefill, then decode
                work.set_attribute("gen_ai.latency.time_to_first_token", t_first - t_admitted)
                work.set_attribute("gen_ai.latency.time_in_model_decode", max(0.0, t_done - t_first))
            timings = state.get("engine_timings")
            if timings is not None:  # the engine's own account (vLLM's per-request stats), vLLM's names
                work.set_attributes({
                    "gen_ai.latency.time_in_queue": timings.queued,
                    "gen_ai.latency.time_in_model_prefill": timings.prefill,
                    "gen_ai.latency.time_in_model_decode": timings.decode,
                    "gen_ai.latency.time_in_model_inference": timings.inference,
                })
            work.end(end_time=ns(max(t_done, t_admitted)))
        if t_response is not None and t_admitted is not None:  # a refusal's error body is no stream
            st = tracer.start_span("gateway.stream", context=ctx, start_time=ns(t_response))
            st.end(end_time=ns(end))
        attrs: dict[str, Any] = {"http.response.status_code": status}
        route = getattr(scope.get("route"), "path", None)
        if route:
            attrs["http.route"] = route
            op = _OPERATIONS.get(route)
            if op:
                attrs["gen_ai.operation.name"] = op
        if rec is not None and rec.get("client"):
            attrs["client.address"] = rec["client"]
        if state.get("request_id"):
            attrs["gen_ai.request.id"] = state["request_id"]
        if model is not None:
            attrs["gen_ai.request.model"] = model
        if target is not None:
            attrs["gen_ai.response.model"] = target
        if state.get("key") is not None:
            attrs["npugw.key_name"] = state["key"]
        for name, field in (("gen_ai.usage.input_tokens", "prompt_tokens"),
                            ("gen_ai.usage.output_tokens", "completion_tokens"),
                            ("gen_ai.usage.cache_read.input_tokens", "cached_tokens")):
            v = state.get(field)
            if v is not None:
                attrs[name] = v
        finish = state.get("finish_reasons")
        if finish:
            attrs["gen_ai.response.finish_reasons"] = sorted(finish)
        if t_first is not None:
            attrs["gen_ai.latency.time_to_first_token"] = t_first - start
        if t_admit is not None and t_admitted is not None:
            attrs["gen_ai.latency.time_in_queue"] = t_admitted - t_admit
        attrs["gen_ai.latency.e2e"] = end - start
        span.set_attributes(attrs)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=ns(end))


def now_ns() -> int:
    return time.time_ns()
