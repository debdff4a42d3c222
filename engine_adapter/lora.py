"""LoRA adapters as served models: many fine-tunes on one base model.

An adapter is a served name of its own (`AdapterPool`): it has the pool
surface the HTTP layer uses (engine_adapter/routing/router.py ServedPool),
so every endpoint, key access list, alias, canary and fallback takes it like
any model. Admission and queueing stay the base model's pool's: an adapter's
requests are the base model's requests with `lora` set (local vLLM engines
run them with a `LoRARequest`) or, for upstream nodes, passed through with
the adapter's name as the node's model id (`RelayCall.node_model`).

The adapters themselves (load on every worker, unload, persistence) are
engine_adapter/lora_manager.py's. This module reads and checks an adapter
folder the way `vllm serve` does before its engine sees it (PEFT's
adapter_config.json: a LoRA, its rank within `--max-lora-rank`, weights
present), and counts requests, tokens and TTFT per adapter.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine_adapter.errors import InvalidRequest, ModelNotFound
from engine_adapter.lease import Ask, LocalLease, Relayed, RelayLease, Tagged, WrappedLocal, WrappedRelay
from engine_adapter.types import (
    Embedded,
    EmbeddingRequest,
    EngineStats,
    GenerationRequest,
    LoraRef,
    ModelCard,
    RelayCall,
    RelayUsage,
    Tokenizer,
)

# vLLM's MaxLoRARanks (vllm/config/lora.py): the ranks --max-lora-rank takes.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
L = TypeVar("L", LocalLease, RelayLease)  # a lease kind


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One `--lora-modules` entry (or one persisted load)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoraModule:
    """vLLM's two forms: `name=path`, or a JSON object
    `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = item.strip()
    if "=" in text and "," not in text and not text.startswith("{"):
        name, _, path = text.partition("=")
        if not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH or a JSON object")
        return LoraModule(name.strip(), path.strip())
    try:
        obj = json.loads(text)
    except ValueError:
        raise ValueError(f"--lora-modules {item!r}: invalid JSON (expected NAME=PATH or a JSON object)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--lora-modules {item!r}: expected a JSON object")
    unknown = sorted(set(obj) - {"name", "path", "base_model_name", "is_3d_lora_weight"})
    if unknown:
        raise ValueError(f"--lora-modules {item!r}: unknown fields {', '.join(unknown)}")
    got_name, got_path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
    if not isinstance(got_name, str) or not got_name or not isinstance(got_path, str) or not got_path:
        raise ValueError(f"--lora-modules {item!r}: `name` and `path` are required strings")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules {item!r}: `base_model_name` must be a string")
    return LoraModule(got_name, got_path, base if isinstance(base, str) else None)


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    path: str  # absolute
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None  # base_model_name_or_path as the adapter was trained on


def read_adapter(name: str, path: str, max_rank: int) -> AdapterInfo:
    """Check a PEFT LoRA folder before any engine loads it; an
    `InvalidRequest` (400) that names the problem otherwise. Local folders
    only: the gateway never downloads from a hub."""
    where = f"LoRA adapter {name!r}"
    folder = Path(path).expanduser()
    if not folder.is_absolute():
        folder = folder.resolve()
    if not folder.exists():
        raise InvalidRequest(f"{where}: lora_path {path!r} does not exist on this host", param="lora_path",
                             code="lora_path_not_found")
    if not folder.is_dir():
        raise InvalidRequest(f"{where}: lora_path {path!r} is not a folder", param="lora_path",
                             code="lora_path_not_found")
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise InvalidRequest(f"{where}: {folder} has no adapter_config.json (not a PEFT adapter)",
                             param="lora_path", code="invalid_lora_adapter")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{where}: cannot read {cfg_file}: {e}", param="lora_path",
                             code="invalid_lora_adapter") from None
    if not isinstance(cfg, dict):
        raise InvalidRequest(f"{where}: {cfg_file} is not a JSON object", param="lora_path",
                             code="invalid_lora_adapter")
    peft_type = str(cfg.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise InvalidRequest(f"{where}: peft_type {peft_type} is not LORA (vLLM serves LoRA adapters only)",
                             param="lora_path", code="invalid_lora_adapter")
    r = cfg.get("r")
    patterns = cfg.get("rank_pattern") or {}
    ranks = [r, *(patterns.values() if isinstance(patterns, dict) else ())]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ranks):
        raise InvalidRequest(f"{where}: rank `r` in {cfg_file} must be a positive integer, got {r!r}",
                             param="lora_path", code="invalid_lora_adapter")
    top = max(ranks)
    if top > max_rank:
        raise InvalidRequest(
            f"{where}: LoRA rank {top} is greater than the maximum rank {max_rank} (--max-lora-rank)",
            param="lora_path", code="lora_rank_too_large",
        )
    if not any((folder / w).is_file() for w in ADAPTER_WEIGHTS):
        raise InvalidRequest(f"{where}: {folder} has no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})",
                             param="lora_path", code="invalid_lora_adapter")
    targets = cfg.get("target_modules") or ()
    return AdapterInfo(
        path=str(folder),
        rank=int(r),  # type: ignore[arg-type]  # checked above
        alpha=float(cfg.get("lora_alpha") or r),  # type: ignore[arg-type]
        target_modules=tuple(targets) if isinstance(targets, list) else (str(targets),),
        base_model=cfg.get("base_model_name_or_path"),
    )


# ---------------------------------------------------------------- metrics

_LATENCY = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # vLLM's TTFT buckets (engine_adapter/metrics.py)


class LoraMetrics:
    """Per adapter: requests admitted, prompt and generated tokens, and time
    to first token (from admission's start, queue wait included)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        labels = ["adapter", "base_model"]
        r = registry
        self.requests = Counter("npugw_lora_requests", "Requests admitted per LoRA adapter.", labels, registry=r)
        self.prompt_tokens = Counter(
            "npugw_lora_prompt_tokens", "Prompt tokens of the requests per LoRA adapter.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "npugw_lora_generation_tokens", "Generated tokens per LoRA adapter.", labels, registry=r
        )
        self.ttft = Histogram(
            "npugw_lora_time_to_first_token_seconds",
            "Time to first token per LoRA adapter (from admission, queue wait included).",
            labels, buckets=_LATENCY, registry=r,
        )

    def init(self, adapter: str, base: str) -> None:
        """Every series of a new adapter at 0."""
        for m in (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft):
            m.labels(adapter, base)

    def remove(self, adapter: str, base: str) -> None:
        for m in (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft):
            try:
                m.remove(adapter, base)
            except KeyError:
                pass


# ---------------------------------------------------------------- served pool


class _AdapterAsk:
    """A route's Ask, for the adapter: local requests carry the LoRA, a
    pass-through call names the adapter on the node."""

    __slots__ = ("_inner", "_pool")

    def __init__(self, inner: Ask, pool: AdapterPool) -> None:
        self._inner = inner
        self._pool = pool

    def local(self, pool: Any, model: str) -> list[GenerationRequest]:
        return [replace(r, lora=self._pool.ref) for r in self._inner.local(pool, model)]

    def relay(self, model: str) -> RelayCall:
        return replace(self._inner.relay(model), node_model=self._pool.node_name)


class AdapterPool:
    """A LoRA adapter served under its own name on its base model's pool (a
    local WorkerPool whose engines run it, or an upstream whose nodes serve
    it by name)."""

    def __init__(
        self,
        name: str,
        base: Any,  # the base model's WorkerPool
        base_name: str,
        *,
        ref: LoraRef | None = None,
        node_name: str | None = None,
        root: str = "",
        metrics: LoraMetrics | None = None,
        source: str = "api",
    ) -> None:
        self.name = name
        self.base = base
        self.base_name = base_name
        self.ref = ref  # local engines: the adapter to run with
        self.node_name = node_name  # upstream nodes: the adapter's id there
        self.root = root or (ref.path if ref else name)
        self.metrics = metrics
        self.source = source  # "flag" (--lora-modules), "api" (loaded at run time), "upstream" (discovered)
        self.loaded = True
        self.created = int(time.time())
        if metrics is not None:
            metrics.init(name, base_name)

    # ---- the pool surface ------------------------------------------------
    @property
    def card(self) -> ModelCard:
        card: ModelCard = self.base.card
        return replace(card, root=self.root)

    @property
    def tokenizer(self) -> Tokenizer:
        tok: Tokenizer = self.base.tokenizer
        return tok

    @property
    def relays(self) -> bool:
        return bool(self.base.relays)

    async def ensure_started(self) -> None:
        await self.base.ensure_started()

    @property
    def running(self) -> int:
        return int(self.base.running)

    @property
    def queue_depth(self) -> int:
        return int(self.base.queue_depth)

    def stats(self) -> list[EngineStats]:
        return list(self.base.stats())

    def ready(self, now: float | None = None) -> bool:
        return self.loaded and bool(self.base.ready(now))

    def alive_workers(self) -> int:
        return int(self.base.alive_workers())

    def ready_workers(self, now: float | None = None) -> int:
        return int(self.base.ready_workers(now))

    async def embed(self, req: EmbeddingRequest, session: str | None = None) -> Embedded:
        raise InvalidRequest(f"The model `{self.name}` is a LoRA adapter of a generation model; it does not embed.",
                             param="model")

    async def acquire(
        self, ask: Ask, session: str | None = None, model: str | None = None
    ) -> AdapterLease | AdapterRelayLease:
        if not self.loaded:  # unloaded while the request was on its way
            raise ModelNotFound(f"The model `{self.name}` does not exist.", param="model")
        start = time.monotonic()
        lease = await self.base.acquire(_AdapterAsk(ask, self), session, model=model or self.name)
        if self.metrics is not None:
            self.metrics.requests.labels(self.name, self.base_name).inc()
        if isinstance(lease, RelayLease):
            return AdapterRelayLease(lease, self, start)
        return AdapterLease(lease, self, start)


def _labels(pool: AdapterPool) -> tuple[str, str] | None:
    return (pool.name, pool.base_name) if pool.metrics is not None else None


class _Counted(Generic[L]):
    """The base pool's lease (`inner`), counted for the adapter's metrics."""

    __slots__ = ("_inner", "_pool", "_start")
    _inner: L

    def __init__(self, inner: L, pool: AdapterPool, start: float) -> None:
        self._inner = inner
        self._pool = pool
        self._start = start

    @property
    def served_by(self) -> str:
        return self._inner.served_by


class AdapterLease(_Counted[LocalLease], WrappedLocal):
    """The base pool's local lease: tokens and TTFT counted as they come."""

    __slots__ = ()

    async def stream(self, idle_tick: float | None = None) -> AsyncGenerator[Tagged, None]:
        m, labels = self._pool.metrics, _labels(self._pool)
        if m is None or labels is None:
            async with aclosing(self._inner.stream(idle_tick)) as plain:
                async for item in plain:
                    yield item
            return
        m.prompt_tokens.labels(*labels).inc(sum(len(r.prompt_token_ids) for r in self._inner.requests))
        first = True
        gen = m.generation_tokens.labels(*labels)
        async with aclosing(self._inner.stream(idle_tick)) as stream:
            async for tag, batch in stream:
                if batch:
                    if first:
                        first = False
                        m.ttft.labels(*labels).observe(time.monotonic() - self._start)
                    gen.inc(sum(len(o.token_ids) for o in batch))
                yield tag, batch


class AdapterRelayLease(_Counted[RelayLease], WrappedRelay):
    """The base pool's relay lease (nodes that serve the adapter by name):
    counted from the usage the node reports."""

    __slots__ = ()

    async def relay(self) -> AsyncGenerator[Relayed, None]:
        m, labels = self._pool.metrics, _labels(self._pool)
        first = True
        async with aclosing(self._inner.relay()) as items:
            async for item in items:
                if m is not None and labels is not None:
                    if isinstance(item, RelayUsage):
                        m.prompt_tokens.labels(*labels).inc(item.prompt_tokens)
                        m.generation_tokens.labels(*labels).inc(item.completion_tokens)
                    elif first:
                        first = False
                        m.ttft.labels(*labels).observe(time.monotonic() - self._start)
                yield item
