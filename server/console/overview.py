"""`GET /console/api/overview`'s body: every model with its workers and
their state, queue depth by priority, device memory, routes (aliases,
weights, fallbacks) and upstream health, read live from the pools, the
device monitor and the routing table (nothing here is on the request path).
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from engine_adapter.backends.remote import is_remote
from engine_adapter.devices import DeviceMonitor
from engine_adapter.lease import Worker
from engine_adapter.pool import WorkerPool
from engine_adapter.routing.upstream import upstreams_of
from server.state import Gateway


def worker_state(pool: WorkerPool, w: Worker, ready_window: float, now: float) -> str:
    """ready: serves and showed it recently; not_ready: runs but has not
    (starting up, or hung); restarting: its engine died and is being
    started again; stopped: the pool no longer accepts work."""
    if not w.alive:
        return "restarting" if pool._accepting else "stopped"
    seen = w.last_sign_of_life(pool.passive_readiness)
    return "ready" if seen is not None and now - seen <= ready_window else "not_ready"


def _worker(pool: WorkerPool, w: Worker, now: float) -> dict[str, Any]:
    return {
        "index": w.index,
        "state": worker_state(pool, w, pool._ready_window(), now),
        "in_flight": w.in_flight if w.alive else 0,
        "slots": w.slots,
        "restarts": w.restarts,
    }


def models(gw: Gateway) -> list[dict[str, Any]]:
    now = time.monotonic()
    names: dict[int, list[str]] = {}
    for name, m in gw.base_models.items():
        names.setdefault(id(m.pool), []).append(name)
    out = []
    for p in gw.pools:
        by_prio = p.queue_depth_by_priority()
        out.append({
            "id": p.name,
            "names": names.get(id(p), [p.name]),
            "kind": p.card.kind,
            "backend": "upstream" if is_remote(p) else "local",
            "ready": p.ready(),
            "running": p.running,
            "queue_depth": p.queue_depth,
            "queue_by_priority": {str(k): v for k, v in sorted(by_prio.items())},
            "rejected": dict(p.counters.rejected),
            "workers": [_worker(p, w, now) for w in p.workers],
        })
    return out


def devices(monitor: DeviceMonitor | None) -> dict[str, Any]:
    if monitor is None:
        return {"ok": False, "last_ok": None, "error": "no device monitor", "readings": []}
    readings = [
        {
            "kind": r.kind, "device": r.device, "used_bytes": r.used_bytes, "total_bytes": r.total_bytes,
            "utilization": r.utilization, "health": r.health,
        }
        for r in monitor.readings
    ]
    return {
        "ok": monitor.last_refresh_ok, "last_ok": monitor.last_ok, "error": monitor.last_error,
        "readings": readings,
    }


def _no_userinfo(url: str) -> str:
    """A URL without `user:password@` (a node's credentials stay off the page)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def routes(gw: Gateway) -> dict[str, Any]:
    aliases = gw.routing.describe() if gw.routing is not None else {}
    upstreams = []
    for u in upstreams_of(gw.pools):
        urls = [{**d, "url": _no_userinfo(str(d["url"]))} for d in u.describe()]
        upstreams.append({"upstream": u.cfg.name, "urls": urls})
    return {"aliases": aliases, "upstreams": upstreams}


def overview(gw: Gateway, monitor: DeviceMonitor | None) -> dict[str, Any]:
    return {
        "object": "console.overview",
        "time": time.time(),
        "uptime_s": round(time.time() - gw.started_at, 1),
        "status": "draining" if gw.draining else "serving",
        "models": models(gw),
        "devices": devices(monitor),
        "routes": routes(gw),
    }
