"""The engine's side of a trace, through a real gateway (uvicorn): the
engine's own queue/prefill/decode times (EngineOutput.timings, which the
vLLM backend reads from vLLM's per-request stats) become attributes of the
`gen_ai.engine` span, and the request span's context reaches the engine
(GenerationRequest.trace_headers, which the vLLM backend hands to vLLM's
own tracing) from the OpenAI routes and from /generate."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sim_app import serve

import server.tracing
from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from engine_adapter.types import EngineOutput, EngineTimings, GenerationRequest
from server.settings import Settings

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
TIMINGS = EngineTimings(queued=0.25, prefill=0.5, decode=1.0, inference=1.5)


class TimedEngine(SimulatedEngine):
    """A simulated engine that reports its own times on a finished output,
    as the vLLM backend does, and keeps the trace context it was given."""

    def __init__(self, config: SimulatedConfig) -> None:
        super().__init__(config, name="sim")
        self.trace_headers: list[tuple[tuple[str, str], ...]] = []

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        if req.trace_headers:  # not the readiness probe's
            self.trace_headers.append(req.trace_headers)
        async for out in super().generate(req):
            if out.finish_reason is not None:
                out.timings = TIMINGS
            yield out


@pytest.mark.asyncio
async def test_engine_times_on_the_engine_span_and_trace_context_to_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()

    def make_exporter(endpoint: str, protocol: str | None = None) -> SpanExporter:
        return exporter

    monkeypatch.setattr(server.tracing, "make_exporter", make_exporter)
    engines: list[TimedEngine] = []

    def make(i: int) -> TimedEngine:
        engines.append(TimedEngine(SimulatedConfig(max_model_len=256)))
        return engines[-1]

    pools = [(WorkerPool("sim", make), ("sim",), "sim")]
    settings = Settings(otlp_traces_endpoint="http://collector.invalid:4317", access_log_format="off")
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with serve(pools, settings) as (client, _):  # type: ignore[arg-type]
        r = await client.post("/v1/chat/completions", json=chat, headers={"traceparent": TRACEPARENT})
        assert r.status_code == 200 and "[DONE]" in r.text
        r = await client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                              headers={"traceparent": TRACEPARENT})
        assert r.status_code == 200
        r = await client.post("/v1/chat/completions", json={**chat, "stream": False})  # no traceparent
        assert r.status_code == 200
    spans: tuple[ReadableSpan, ...] = exporter.get_finished_spans()
    roots = [s for s in spans if s.name.startswith("POST ")]
    assert len(roots) == 3
    in_client_trace = [s for s in roots if format(s.context.trace_id, "032x") == CLIENT_TRACE]
    assert len(in_client_trace) == 2  # the third request started a trace of its own
    # each engine request carries its own request span's context
    sent = sorted(tuple(dict(h)["traceparent"].split("-")[1:3]) for e in engines for h in e.trace_headers)
    assert sent == sorted((format(s.context.trace_id, "032x"), format(s.context.span_id, "016x")) for s in roots)
    engine_spans = [s for s in spans if s.name == "gen_ai.engine"]
    assert len(engine_spans) == 3
    for s in engine_spans:
        a = s.attributes or {}
        assert a["gen_ai.latency.time_in_queue"] == TIMINGS.queued
        assert a["gen_ai.latency.time_in_model_prefill"] == TIMINGS.prefill
        assert a["gen_ai.latency.time_in_model_decode"] == TIMINGS.decode
        assert a["gen_ai.latency.time_in_model_inference"] == TIMINGS.inference
