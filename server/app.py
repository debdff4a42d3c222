"""The app factory: `create_app(settings, pools=None)`. Shared objects live
in the app's state, built in the lifespan; nothing happens at import."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections import Counter as CounterDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, disable_created_metrics

from engine_adapter.metrics import EngineMetrics
from engine_adapter.pool import WorkerPool
from server import discovery
from server.apis.anthropic import route as messages
from server.apis.chat import route as chat
from server.apis.completions import route as completions
from server.apis.embeddings import route as embeddings
from server.apis.generate import route as generate
from server.apis.responses import route as responses
from server.auth import KeyStore
from server.console import setup_console
from server.errors import install_error_handlers
from server.fast_relay import FastRelay
from server.limits import Limits
from server.metrics import GatewayMetrics, LoopCollector, PoolCollector
from server.metrics_multiproc import AppRegistry, LiveExport, multiprocess_registry
from server.middleware import AccessLog, GatewayMiddleware, RecordSink
from server.queueing import QueueCollector, configure_queues
from server.routes import (
    admin,
    health,
    lora,
    models,
    queue,
    routing_admin,
    tokenize,
)
from server.settings import Settings
from server.state import Gateway
from server.usage import setup_usage, start_usage, stop_usage

if TYPE_CHECKING:
    from server.tracing import Tracing

logger = logging.getLogger(__name__)

ServedPools = list[tuple[WorkerPool, tuple[str, ...], str]]


def freeze_startup_heap() -> None:
    """Move what startup built (tokenizers, engine clients, routes, pydantic
    models) out of the collector's reach, as `vllm serve` does before it
    serves: a full collection then walks only what requests allocate, not
    the whole startup heap, so it stalls the token stream less.
    NPUGW_GC_FREEZE=0 leaves the heap as it is (to measure what this buys)."""
    if os.environ.get("NPUGW_GC_FREEZE", "1") == "0":
        return
    gc.collect()
    gc.freeze()


def create_app(
    settings: Settings,
    pools: ServedPools | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """`pools`: (pool, served names, root) per model; built from `settings`
    in the lifespan when not given. Given pools are started and stopped by
    the app too."""
    disable_created_metrics()  # type: ignore[no-untyped-call]  # as vLLM: no *_created series
    registry = registry if registry is not None else AppRegistry()
    gw_metrics = GatewayMetrics(registry)
    # One of several gateway processes (--workers N): /metrics covers them all.
    mp_registry = multiprocess_registry(registry)
    holder: dict[str, Gateway] = {}
    access_log, tracing = _observability(settings)
    state_store = None
    if settings.state_url is not None:
        from server.state_store import StateStore

        state_store = StateStore(settings.state_url, settings.state_timeout, settings.state_lease_ttl, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from server.devices import start_device_monitor

        served = pools
        if served is None:
            from server.models_setup import build_served_pools

            served = build_served_pools(settings, EngineMetrics(registry, settings.max_model_len or 8192))
        gw = Gateway(settings, served)
        configure_queues(gw.pools, settings.queue_policy, app.state.keys.entries)  # fair share, the keys' weights
        gw.limits = Limits(gw_metrics, state_store, settings.state_fail)  # state_store: --state-url
        gw.limits.budgets = app.state.usage.budgets  # server/usage: the keys' budgets at admission
        holder["gw"] = gw
        app.state.gateway = gw
        started: list[WorkerPool] = []
        monitor = None
        live_export = LiveExport(mp_registry) if mp_registry is not None else None

        async def start(p: WorkerPool) -> None:
            await p.start()
            started.append(p)

        if access_log is not None:
            access_log.start()
        if tracing is not None:
            tracing.start()
        try:
            await start_usage(app)  # the usage ledger: migrations, budgets from the database, its writer
            if state_store is not None:
                state_store.attach_budgets(app.state.usage.budgets)  # budgets' running totals, shared
                await state_store.start()  # unreachable: follows --state-fail, probes until it answers
            await asyncio.gather(*(start(p) for p in gw.pools))
            discovery.start_discovery(app, gw)  # models the upstream nodes list, before aliases name them
            await lora.start_lora(app, gw)  # adapters first: aliases may name them
            routing_admin.start_routing(app, gw)  # aliases and fallbacks over started pools; SIGHUP reloads
            monitor = await start_device_monitor(settings, registry)
            app.state.device_monitor = monitor  # the console's device memory
            if live_export is not None:
                live_export.start()
            logger.info("serving %s", ", ".join(gw.models))
            freeze_startup_heap()
            yield
        finally:
            if live_export is not None:
                await live_export.stop()
            routing_admin.stop_routing(app)
            discovery.stop_discovery(app)
            await lora.stop_lora(app)
            gw.draining = True
            await asyncio.gather(*(p.stop(settings.shutdown_timeout) for p in started))
            await stop_usage(app)  # the usage ledger writes (or spools) what is left
            if state_store is not None:
                await state_store.close()
            if monitor is not None:
                await monitor.stop()
            if tracing is not None:
                await asyncio.to_thread(tracing.stop)  # flushes the last spans
            if access_log is not None:
                access_log.stop()

    app = FastAPI(
        title="npu-gateway",
        summary="OpenAI-compatible gateway for vLLM engines on Ascend NPUs, GPUs and CPUs",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.registry = registry
    if mp_registry is not None:
        from server.metrics_multiproc import ProcessCollector, exposition_registry

        gw_metrics.process_requests = CounterDict()
        mp_registry.register(ProcessCollector(gw_metrics.process_requests))
        app.state.registry = exposition_registry(mp_registry)
    app.state.metrics = gw_metrics
    app.state.keys = KeyStore.from_settings(settings)
    registry.register(
        PoolCollector(lambda: holder["gw"].pools if "gw" in holder else [], gw_metrics.rejections)
    )
    registry.register(QueueCollector(lambda: holder["gw"].pools if "gw" in holder else []))
    registry.register(LoopCollector())
    install_error_handlers(app)
    for r in (chat, completions, responses, messages, generate, embeddings, models, tokenize, health, admin, queue):
        app.include_router(r.router)
    routing_admin.setup_routing(app, registry)  # /admin/routes, upstream metrics
    lora.setup_lora(app, registry)  # /v1/load_lora_adapter, /v1/unload_lora_adapter, per-adapter metrics
    # Every finished request's record goes to each sink (server/middleware.py);
    # consumers append theirs to app.state.record_sinks.
    record_sinks: list[RecordSink] = []
    app.state.record_sinks = record_sinks
    record_sinks.append(setup_console(app).record)  # /console: its recent requests and latency history
    setup_usage(app, settings, registry)  # the usage ledger (a record sink), budgets, /admin/usage, metrics
    app.add_middleware(
        GatewayMiddleware, metrics=gw_metrics, max_body=settings.max_request_body_bytes,
        access_log=access_log, tracing=tracing, sinks=record_sinks, proxies=settings.parsed.proxies,
        fast=FastRelay(),
    )
    return app


def _observability(settings: Settings) -> tuple[AccessLog | None, Tracing | None]:
    """The access log and the tracer the settings ask for (None: off, at no
    cost per request; OpenTelemetry is not even imported)."""
    access_log = None
    if settings.access_log_format != "off":
        access_log = AccessLog(settings.access_log_format, settings.access_log_file,
                               settings.parsed.proxies)
    tracing = None
    if settings.otlp_traces_endpoint:
        from server.tracing import Tracing

        tracing = Tracing(settings.otlp_traces_endpoint)
    return access_log, tracing
