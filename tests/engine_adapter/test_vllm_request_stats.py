"""The vLLM backend's per-request figures for the trace, on an AsyncLLM
stand-in that yields vLLM's own RequestOutput / RequestStateStats objects:
the engine's queue, prefill and decode times on the finished output, and
the request span's traceparent passed to vLLM's tracing (`trace_headers`)
only when vLLM traces (`--engine-arg otlp_traces_endpoint=...`)."""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine_adapter.backends.vllm import VllmEngine, engine_timings
from engine_adapter.backends.vllm_config import VllmConfig
from engine_adapter.types import EngineOutput, GenerationRequest, SamplingOptions

pytest.importorskip("vllm")
with warnings.catch_warnings():  # torch's own deprecations, raised while vLLM imports it
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.sampling_params  # what generate() imports, imported here under the filter
    import vllm.v1.engine.exceptions  # noqa: F401
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.metrics.stats import RequestStateStats

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class RecordingLLM:
    """AsyncLLM.generate as far as the adapter uses it: records its keyword
    arguments, streams three one-token deltas, and moves the request's
    RequestStateStats along as vLLM's output processor does (engine-core
    monotonic timestamps: queued 100.0, scheduled 100.5, tokens at 101.0,
    101.2, 101.5)."""

    errored = False

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, **kw: Any) -> AsyncIterator[RequestOutput]:
        self.calls.append(kw)
        stats = RequestStateStats(arrival_time=1.0, queued_ts=100.0, scheduled_ts=100.5)
        for i, ts in enumerate((101.0, 101.2, 101.5)):
            if i == 0:
                stats.first_token_ts = ts
            stats.last_token_ts = ts
            last = i == 2
            co = CompletionOutput(index=0, text=f"t{i}", token_ids=[10 + i], cumulative_logprob=None, logprobs=None,
                                  finish_reason="length" if last else None)
            yield RequestOutput(request_id, None, list(prompt["prompt_token_ids"]), None, [co], finished=last,
                                metrics=stats)


def engine(**extra: Any) -> tuple[VllmEngine, RecordingLLM]:
    e = VllmEngine(VllmConfig(model="/m", served_model_name="m", extra=extra))
    llm = RecordingLLM()
    e._llm = llm
    return e, llm


def request(trace: tuple[tuple[str, str], ...] = ()) -> GenerationRequest:
    return GenerationRequest("r1", "m", (1, 2, 3), SamplingOptions(max_tokens=3), trace_headers=trace)


async def run(e: VllmEngine, req: GenerationRequest) -> list[EngineOutput]:
    return [o async for o in e.generate(req)]


@pytest.mark.asyncio
async def test_the_finished_output_carries_the_engines_times() -> None:
    e, _ = engine()
    outs = await run(e, request())
    assert [o.timings for o in outs[:-1]] == [None, None]  # only the finished choice's last delta
    t = outs[-1].timings
    assert t is not None and outs[-1].finish_reason == "length"
    assert t.queued == pytest.approx(0.5) and t.prefill == pytest.approx(0.5)
    assert t.decode == pytest.approx(0.5) and t.inference == pytest.approx(1.0)


def test_no_times_without_stats_or_schedule() -> None:
    assert engine_timings(None) is None  # the engine keeps no stats (disable_log_stats)
    assert engine_timings(RequestStateStats(arrival_time=1.0, queued_ts=5.0)) is None  # aborted while queued


@pytest.mark.asyncio
async def test_traceparent_goes_to_vllm_only_when_vllm_traces() -> None:
    trace = (("traceparent", TRACEPARENT), ("tracestate", "k=v"))
    e, llm = engine(otlp_traces_endpoint="http://collector:4317")
    await run(e, request(trace))
    await run(e, request())
    assert llm.calls[0]["trace_headers"] == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert llm.calls[1]["trace_headers"] is None  # no context: nothing to join
    e, llm = engine()  # vLLM not tracing: it would drop the headers with a warning per request
    await run(e, request(trace))
    assert llm.calls[0]["trace_headers"] is None
