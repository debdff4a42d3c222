"""Models discovered on upstream nodes (`--upstream URL[,URL...]`, or
`;model=*`): each model the nodes list is served here under its own id, and
the list follows the health checks. A model that appears on a node becomes
routable; one that no node lists any more is no longer served (404), unless
an alias names it (then it stays, refused with the reason, until the alias
changes). An id served here already (a local model, another upstream) is
not taken over: logged once."""

from __future__ import annotations

import logging

from fastapi import FastAPI

from engine_adapter.backends.discovered import DiscoveredModel
from engine_adapter.pool import WorkerPool
from engine_adapter.routing.upstream import Upstream, upstreams_of
from server.state import Gateway

logger = logging.getLogger(__name__)


class Discovery:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.sources: list[tuple[WorkerPool, Upstream]] = [
            (p, up) for p in gw.pools for up in upstreams_of([p]) if up.cfg.discovers
        ]
        self.served: dict[str, DiscoveredModel] = {}
        self._clashes: set[tuple[str, str]] = set()
        self._kept: set[str] = set()

    def sync(self) -> None:
        """Serve what the nodes list now; drop what none lists."""
        gw, listed = self.gw, set()
        for pool, up in self.sources:
            for name in up.listed():
                if name in listed:
                    continue
                listed.add(name)
                mine = self.served.get(name)
                if mine is not None and mine.upstream is up:
                    continue
                if mine is not None or gw.serves(name):
                    if (name, up.cfg.name) not in self._clashes:
                        self._clashes.add((name, up.cfg.name))
                        logger.warning("model %s listed by upstream %s: the name is served here already; "
                                       "not served from there", name, up.cfg.name)
                    continue
                model = DiscoveredModel(name, pool, up)
                self.served[name] = model
                gw.add_served(name, model, root=name, parent=None)
                logger.info("model %s: served by upstream %s (discovered)", name, up.cfg.name)
        for name in [n for n in self.served if n not in listed]:
            if gw.routes_using(name):
                if name not in self._kept:
                    self._kept.add(name)
                    logger.warning("model %s: no upstream node lists it any more; still served for the aliases "
                                   "that name it (%s), refused until a node lists it again",
                                   name, ", ".join(gw.routes_using(name)))
                continue
            self._kept.discard(name)
            del self.served[name]
            gw.remove_served(name)
            logger.warning("model %s: no upstream node lists it any more; not served", name)


def start_discovery(app: FastAPI, gw: Gateway) -> None:
    """In the lifespan, once the pools run (their first checks are done):
    serve what the nodes list, then follow each change the checks see."""
    d = Discovery(gw)
    app.state.discovery = d
    if not d.sources:
        return
    d.sync()
    for _, up in d.sources:
        up.listeners.append(d.sync)


def stop_discovery(app: FastAPI) -> None:
    d: Discovery | None = getattr(app.state, "discovery", None)
    if d is None:
        return
    for _, up in d.sources:
        if d.sync in up.listeners:
            up.listeners.remove(d.sync)
