"""OpenTelemetry traces from a real gateway (uvicorn) to a real OTLP/HTTP
receiver (aiohttp, decoding with opentelemetry-proto): the request span and
its children, the client's traceparent honoured, and the trace context
reaching an upstream node of the gateway tier."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from fakes import FakeNode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sim_app import serve
from support import free_port, wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from server.settings import Settings

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/v1/traces", self.traces)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def traces(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        for rs in req.resource_spans:
            self.resources.append({a.key: a.value.string_value for a in rs.resource.attributes})
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def node_saying_hi() -> FakeNode:
    """A node that streams one word and its usage (5 in, 1 out)."""
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    return await FakeNode(words=["hi"], usage=usage, usage_always=True).start()


@pytest_asyncio.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Receiver]:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    r = await Receiver().start()
    yield r
    await r.stop()


def hexid(b: bytes) -> str:
    return b.hex()


def attrs(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = list(x.string_value for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)
    return out


def children(spans: list[Span], parent: Span) -> dict[str, Span]:
    return {s.name: s for s in spans if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id}


def sim_pools() -> list[tuple[WorkerPool, tuple[str, ...], str]]:
    cfg = SimulatedConfig(max_model_len=256, ttft=0.02, itl=0.001)
    return [(WorkerPool("sim", lambda i: SimulatedEngine(cfg, name="sim")), ("sim",), "sim")]


@pytest.mark.asyncio
async def test_local_request_spans_and_client_traceparent(receiver: Receiver) -> None:
    settings = Settings(otlp_traces_endpoint=receiver.url, api_key=["sk-1"], access_log_format="off")
    body = {"model": "sim", "messages": [{"role": "user", "content": "secret words"}], "max_tokens": 3,
            "stream": True}
    async with serve(sim_pools(), settings) as (client, _):
        r = await client.post("/v1/chat/completions", json=body,
                              headers={"traceparent": TRACEPARENT, "Authorization": "Bearer sk-1"})
        assert r.status_code == 200 and "[DONE]" in r.text
        r = await client.post("/v1/chat/completions", json={**body, "stream": False},
                              headers={"Authorization": "Bearer sk-1"})
        assert r.status_code == 200
        r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
    # the app's shutdown flushes the batch exporter
    await wait_until(lambda: sum(s.kind == Span.SPAN_KIND_SERVER for s in receiver.spans) == 3, what="3 traces")
    assert receiver.resources[0]["service.name"] == "npu-gateway"
    roots = [s for s in receiver.spans if s.kind == Span.SPAN_KIND_SERVER]
    streamed = next(s for s in roots if hexid(s.trace_id) == CLIENT_TRACE)
    assert hexid(streamed.parent_span_id) == CLIENT_SPAN  # the client's span is the parent
    a = attrs(streamed)
    assert streamed.name == "POST /v1/chat/completions"
    assert a["http.route"] == "/v1/chat/completions" and a["http.response.status_code"] == 200
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "sim"
    assert a["gen_ai.response.model"] == "sim" and a["npugw.key_name"] == "key-1"
    assert a["gen_ai.usage.output_tokens"] == 3 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.latency.time_to_first_token"] >= 0.02
    assert "sk-1" not in str(receiver.spans) and "secret words" not in str(receiver.spans)
    kids = children(receiver.spans, streamed)
    assert set(kids) == {"gateway.admission", "gen_ai.engine", "gateway.stream"}
    adm, eng, st = kids["gateway.admission"], kids["gen_ai.engine"], kids["gateway.stream"]
    assert streamed.start_time_unix_nano <= adm.start_time_unix_nano <= adm.end_time_unix_nano
    assert adm.end_time_unix_nano <= eng.start_time_unix_nano <= eng.end_time_unix_nano <= streamed.end_time_unix_nano
    assert st.start_time_unix_nano >= adm.end_time_unix_nano and st.end_time_unix_nano <= streamed.end_time_unix_nano
    assert attrs(eng)["gen_ai.latency.time_to_first_token"] >= 0.02
    others = [s for s in roots if s is not streamed]
    assert all(s.parent_span_id == b"" for s in others)  # no traceparent: a new trace
    refused = next(s for s in others if attrs(s)["http.response.status_code"] == 401)
    assert children(receiver.spans, refused) == {}  # never admitted
    assert set(children(receiver.spans, next(s for s in others if s is not refused))) == {
        "gateway.admission", "gen_ai.engine", "gateway.stream"}


@pytest.mark.asyncio
async def test_upstream_node_gets_the_trace_context(receiver: Receiver) -> None:
    node = await node_saying_hi()
    try:
        settings = Settings(model="none", upstream=[f"remote={node.url}"], readiness_interval=1,
                            otlp_traces_endpoint=receiver.url, access_log_format="off")
        body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with serve(None, settings) as (client, _):
            r = await client.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT})
            assert r.status_code == 200 and "[DONE]" in r.text
        await wait_until(lambda: any(s.kind == Span.SPAN_KIND_SERVER for s in receiver.spans), what="the trace")
    finally:
        await node.stop()
    root = next(s for s in receiver.spans if s.kind == Span.SPAN_KIND_SERVER)
    assert hexid(root.trace_id) == CLIENT_TRACE
    sent = node.calls[-1][2]["traceparent"]
    # the node continues the same trace, under the gateway's request span
    assert sent == f"00-{CLIENT_TRACE}-{hexid(root.span_id)}-01"
    kids = children(receiver.spans, root)
    assert set(kids) == {"gateway.admission", "gen_ai.upstream", "gateway.stream"}
    up = kids["gen_ai.upstream"]
    assert up.kind == Span.SPAN_KIND_CLIENT and attrs(up)["gen_ai.response.model"] == "remote"
    assert attrs(root)["gen_ai.usage.output_tokens"] == 1


@pytest.mark.asyncio
async def test_without_tracing_the_client_traceparent_still_reaches_the_node() -> None:
    node = await node_saying_hi()
    try:
        settings = Settings(model="none", upstream=[f"remote={node.url}"], readiness_interval=1,
                            access_log_format="off")
        body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}]}
        async with serve(None, settings) as (client, _):
            r = await client.post("/v1/chat/completions", json=body,
                                  headers={"traceparent": TRACEPARENT, "tracestate": "k=v"})
            assert r.status_code == 200
    finally:
        await node.stop()
    assert node.calls[-1][2]["traceparent"] == TRACEPARENT and node.calls[-1][2]["tracestate"] == "k=v"


def test_protocol_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    from server.tracing import make_exporter

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert isinstance(make_exporter("http://127.0.0.1:4317"), Grpc)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    exp = make_exporter("http://127.0.0.1:4318")
    assert isinstance(exp, Http) and exp._endpoint == "http://127.0.0.1:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        make_exporter("http://x")
