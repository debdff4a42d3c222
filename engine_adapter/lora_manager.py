"""The LoRA adapters a gateway serves: loaded on every worker of their base
model, unloaded, persisted, restored at start, and those upstream nodes
serve (discovered from their `/v1/models`).

- Load (`--lora-modules` at start, `POST /v1/load_lora_adapter` at run
  time): the folder is checked first (engine_adapter/lora.py
  `read_adapter`: adapter_config.json, rank within `--max-lora-rank`,
  weights present), then added to each live worker's engine in turn
  (vLLM's `add_lora`, which reads the weights and preloads them). If one
  worker refuses, the workers that took it drop it again: no worker is left
  half-loaded, and the error is a 400 naming what the engine said. A worker
  restarting meanwhile gets the adapter when a request first uses it (each
  request carries the adapter's path, and vLLM loads on demand).
- Unload: removed from every worker; requests already running finish, new
  ones get 404.
- Upstream nodes (`--upstream`): the entries of a node's `/v1/models` whose
  `parent` is the node's model are its adapters (engine_adapter/routing/
  upstream.py reads them at each health check); each is served here under
  its own name and passed through by name (`sync_upstreams`). One a node
  no longer lists is dropped.
- Persistence: adapters loaded at run time are written to
  `DATA_DIR/lora_adapters.json` (atomically) and loaded again at start,
  after the `--lora-modules` ones; one that no longer loads (its folder
  gone) is logged and dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from engine_adapter.errors import GatewayError, InvalidRequest, NotFound
from engine_adapter.lora import AdapterPool, LoraMetrics, LoraModule, read_adapter
from engine_adapter.routing.upstream import upstreams_of
from engine_adapter.types import LoraRef

logger = logging.getLogger(__name__)

STORE_NAME = "lora_adapters.json"


class LoraManager:
    def __init__(
        self,
        bases: Mapping[str, Any],
        *,
        max_rank: int = 16,
        store: Path | None = None,
        metrics: LoraMetrics | None = None,
        taken: Callable[[str], bool] = lambda name: False,
    ) -> None:
        """`bases`: base model name -> its local WorkerPool (the models whose
        engines run with LoRA on; the first is the default base). `taken`:
        whether a name is already served otherwise (a model, an alias)."""
        self.bases = dict(bases)
        self.max_rank = max_rank
        self.store = store
        self.metrics = metrics
        self.taken = taken
        self.adapters: dict[str, AdapterPool] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._clashes: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.bases)

    def _base(self, name: str | None) -> tuple[str, Any]:
        if not self.bases:
            raise InvalidRequest("LoRA is off on this server: start it with --enable-lora", code="lora_disabled")
        if name is None:
            return next(iter(self.bases.items()))
        pool = self.bases.get(name)
        if pool is None:
            raise InvalidRequest(
                f"base_model_name {name!r} is not a local model with LoRA on (these are: {', '.join(self.bases)})",
                param="base_model_name",
            )
        return name, pool

    # ---- load / unload ------------------------------------------------------
    async def load(
        self, module: LoraModule, *, load_inplace: bool = False, source: str = "api"
    ) -> AdapterPool:
        """Check, then load on every live worker of the base model; all or
        nothing. An `InvalidRequest` (400) says what is wrong."""
        name = module.name
        if not name or not module.path:
            raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        async with self._lock:
            current = self.adapters.get(name)
            if current is not None and not load_inplace:
                raise InvalidRequest(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                    "set 'load_inplace' to True.", param="lora_name", code="lora_already_loaded",
                )
            if current is None and self.taken(name):
                raise InvalidRequest(f"The lora adapter '{name}' conflicts with a served model or alias.",
                                     param="lora_name")
            base_name, pool = self._base(module.base_model_name or (current.base_name if current else None))
            info = read_adapter(name, module.path, self.max_rank)
            ref = LoraRef(name, current.ref.id if current and current.ref else next(self._ids), info.path)
            await self._add_everywhere(pool, ref, replace=current is not None)
            if current is not None:
                current.loaded = False
            adapter = AdapterPool(name, pool, base_name, ref=ref, root=info.path, metrics=self.metrics, source=source)
            self.adapters[name] = adapter
            logger.info("LoRA adapter %s loaded on %s (rank %d, %s) from %s",
                        name, base_name, info.rank, ",".join(info.target_modules), info.path)
            if source == "api":
                await self._save()
            return adapter

    async def _add_everywhere(self, pool: Any, ref: LoraRef, replace: bool) -> None:
        done: list[Any] = []
        try:
            for w in pool.workers:
                if not w.alive:
                    continue
                add = getattr(w.engine, "add_lora", None)
                if add is None:
                    raise InvalidRequest(f"the engines of model {pool.name!r} do not take LoRA adapters")
                await add(ref, replace=replace)
                done.append(w.engine)
        except BaseException as e:
            for engine in done:
                try:
                    await engine.remove_lora(ref)
                except Exception:
                    logger.warning("LoRA adapter %s: undoing its load on a worker failed", ref.name, exc_info=True)
            if isinstance(e, GatewayError):
                raise
            if isinstance(e, Exception):
                raise InvalidRequest(f"LoRA adapter {ref.name!r} failed to load: {e}", param="lora_path") from e
            raise

    async def unload(self, name: str) -> AdapterPool:
        async with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None or adapter.source == "upstream":
                raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               code="lora_not_found")
            del self.adapters[name]
            adapter.loaded = False
            ref = adapter.ref
            if ref is not None:
                for w in adapter.base.workers:
                    remove = getattr(w.engine, "remove_lora", None)
                    if remove is None or not w.alive:
                        continue
                    try:
                        await remove(ref)
                    except Exception:  # it is gone for requests either way
                        logger.warning("LoRA adapter %s: removing it from %s worker %d failed",
                                       name, adapter.base_name, w.index, exc_info=True)
            if self.metrics is not None:
                self.metrics.remove(name, adapter.base_name)
            logger.info("LoRA adapter %s unloaded", name)
            await self._save()
            return adapter

    # ---- upstream nodes ---------------------------------------------------------
    def sync_upstreams(self, pools: Iterable[Any]) -> tuple[list[AdapterPool], list[AdapterPool]]:
        """The adapters upstream nodes list now (what each URL's last good
        /v1/models said): (new ones to serve, ones no node lists any more)."""
        listed: dict[str, tuple[Any, str]] = {}
        for pool in pools:
            for up in upstreams_of([pool]):
                for ep in up.endpoints:
                    for adapter_id, root in ep.adapters.items():
                        listed.setdefault(adapter_id, (pool, root))
        removed = [a for n, a in self.adapters.items() if a.source == "upstream" and n not in listed]
        for a in removed:
            del self.adapters[a.name]
            a.loaded = False
            if self.metrics is not None:
                self.metrics.remove(a.name, a.base_name)
            logger.info("LoRA adapter %s: no upstream node lists it any more", a.name)
        added: list[AdapterPool] = []
        for name, (pool, root) in listed.items():
            if name in self.adapters:
                continue
            if self.taken(name):
                if name not in self._clashes:
                    self._clashes.add(name)
                    logger.warning("LoRA adapter %s of upstream %s: the name is served here already; not served",
                                   name, pool.name)
                continue
            a = AdapterPool(name, pool, pool.name, node_name=name, root=root, metrics=self.metrics, source="upstream")
            self.adapters[name] = a
            added.append(a)
            logger.info("LoRA adapter %s: served by upstream %s (passed through by name)", name, pool.name)
        return added, removed

    # ---- persistence ----------------------------------------------------------
    def persisted(self) -> list[LoraModule]:
        if self.store is None or not self.store.is_file():
            return []
        try:
            data = json.loads(self.store.read_text())
            return [LoraModule(str(a["name"]), str(a["path"]), a.get("base_model_name")) for a in data["adapters"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.error("LoRA adapters: cannot read %s (%s); none restored", self.store, e)
            return []

    async def _save(self) -> None:
        if self.store is None:
            return
        rows = [
            {"name": a.name, "path": a.ref.path, "base_model_name": a.base_name}
            for a in self.adapters.values() if a.source == "api" and a.ref is not None
        ]
        await asyncio.to_thread(_write_atomic, self.store, {"adapters": rows})

    async def restore(self, modules: Iterable[LoraModule]) -> list[AdapterPool]:
        """At start: `--lora-modules` (a failure stops the start, as in vLLM),
        then the adapters loaded at run time before (a failure is logged
        and that adapter dropped)."""
        out = [await self.load(m, source="flag") for m in modules]
        saved = self.persisted()
        for m in saved:
            if m.name in self.adapters:
                logger.warning("LoRA adapter %s: persisted, but --lora-modules names it too; using the flag's", m.name)
                continue
            try:
                out.append(await self.load(m, source="api"))
            except GatewayError as e:
                logger.error("LoRA adapter %s (persisted) not restored: %s", m.name, e.message)
        if saved:
            await self._save()  # drops what did not load
        return out


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
