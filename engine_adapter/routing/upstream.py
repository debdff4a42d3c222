"""Upstreams: the URLs behind one remote model, balanced by least outstanding
requests, each guarded by a circuit breaker (passive) and health checks
(active).

- Breaker: `eject_after` request failures in a row open it; after `cooldown`
  one trial request goes through (half-open); its success closes the
  breaker, its failure opens it again.
- Health checks: `GET /health` and `GET /v1/models` every `health_interval`;
  `eject_after` failed checks in a row eject the URL, one good check brings it
  back. Requests still waiting on an ejected URL for their first byte are
  failed at once (`Endpoint.ejected`), so a router or a retry can move them.
- Silence: every byte from a URL (a health check, response headers, a
  stream read) marks it seen. While non-streamed calls wait on a URL (their
  answer is the first byte), a URL unseen for half of `read_timeout` gets a
  quick `/health` ping, and one unseen for `read_timeout` is ejected, which
  fails its waiters at once: a node that stops answering ends them within
  `read_timeout`, whatever the health-check interval.
- Slots: how many requests a URL runs at once, `;slots=N`, else the
  `slots` of its model card (an npu-gateway node says it). The routing
  policy does not follow a prompt's prefix onto a full URL while another
  has room.
- Model ids: the check learns the node's own model id from `/v1/models`
  (engine_adapter/routing/node_models.py: the one model it serves, else the
  served name if the node lists it, else its generative model where its
  cards say which is which, with /v1/embeddings sent to its embedding
  model, else `;model=ID` must pick one) and its `max_model_len`. A node
  that does not serve the expected model is named in the log, in
  `/admin/routes` and in the refusal, with what it does serve.
- Discovery (`--upstream URL[,URL...]` without a name, or `;model=*`): every
  model the nodes list is served under its own id; each check refreshes
  what a URL lists, a model that appears or disappears is logged and the
  `listeners` are called (server/discovery.py serves or drops the name).
  A request for a model goes only to the URLs that list it.

- Client APIs: the first good check also reads the node's `/openapi.json`
  once, to learn which of the other client APIs it serves (Responses,
  Messages, count_tokens, /generate, TGI; engine_adapter/apis.py),
  unless `;api=a,b` (or `none`) says. A request for one it lacks is sent to
  its chat or completions endpoint instead (the routes translate).

An `Upstream` owns one aiohttp `ClientSession` (a pooled `TCPConnector`, no
global connection limit: the WorkerPool in front bounds concurrency) shared by
every request to it, so a dead or black-holed upstream only ever holds its own
connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import orjson

from engine_adapter.apis import apis_from_openapi, parse_apis
from engine_adapter.entry import parse_entry
from engine_adapter.errors import GatewayError, ServiceUnavailable
from engine_adapter.routing.endpoint import Endpoint, eject, rearm
from engine_adapter.routing.node_models import LISTING_REASONS, Card, NotListed, choose, kind, read_listing
from engine_adapter.routing.policy import RouteKey, RoutingPolicy
from engine_adapter.tasks import cancel_and_wait

__all__ = ["TIMEOUTS", "Endpoint", "Upstream", "UpstreamConfig", "parse_upstream", "upstreams_of"]

logger = logging.getLogger(__name__)

TIMEOUTS = (TimeoutError, asyncio.TimeoutError)
EVERY_MODEL = "*"  # `;model=*`: serve every model the nodes list, under its own id


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    name: str  # the served name here
    urls: tuple[str, ...]
    model: str | None = None  # the node's model id; default: learned from its /v1/models; "*": every one
    connect_timeout: float = 2.0
    read_timeout: float = 30.0  # longest silence: to the headers, between chunks
    health_interval: float = 5.0
    eject_after: int = 3
    cooldown: float = 10.0
    max_model_len: int | None = None  # default: the upstream's /v1/models
    api_key_env: str | None = None  # environment variable holding the upstream key
    api: str | None = None  # the client APIs the node serves (apis.API_NAMES); default: its /openapi.json
    plain: Literal["direct", "stream"] = "direct"  # how a non-streaming client's generation is called
    slots: int | None = None  # requests one URL runs at once (a routing hint); default: its /v1/models "slots"
    # --routing-policy kv-events: each URL's KV event publisher, in URL order, `PUB[|REPLAY]` comma-separated
    # (routing/kv_events.py remote_sources), and a local folder of the nodes' tokenizer to hash prompts with
    kv_events: str | None = None
    kv_tokenizer: str | None = None
    apis: frozenset[str] | None = field(init=False, default=None)  # `api`, parsed; None: from /openapi.json

    def __post_init__(self) -> None:
        if self.api is not None:
            object.__setattr__(self, "apis", parse_apis(self.api, self.name))

    @property
    def discovers(self) -> bool:
        """Every model the nodes list is served, under its own id."""
        return self.model == EVERY_MODEL


_NUMBERS: dict[str, Callable[[str], float | int]] = {
    "connect_timeout": float, "read_timeout": float, "health_interval": float,
    "cooldown": float, "eject_after": int, "max_model_len": int, "slots": int,
}
_TEXTS = ("model", "api_key_env", "api", "plain", "kv_events", "kv_tokenizer")


def parse_upstream(spec: str, **defaults: Any) -> UpstreamConfig:
    """`NAME=URL[,URL...][;option=value...]`; options name UpstreamConfig
    fields. Without `NAME=` (`URL[,URL...][;option=value...]`): every model
    the nodes list (`;model=*`), the upstream named after its first URL."""
    given, unnamed = spec, spec.lstrip().startswith(("http://", "https://"))
    if unnamed:
        head, _, opts = spec.partition(";")
        spec = f"{_label(head)}={head};model=*;{opts}"
    e = parse_entry(spec, "upstream", "[NAME=]URL[,URL...][;option=value...]", options=(*_NUMBERS, *_TEXTS))
    if unnamed and e.options["model"] != EVERY_MODEL:
        raise ValueError(f"upstream {given!r}: ;model=ID needs a name: NAME=URL;model=ID")
    name = e.name
    found = [u.rstrip("/") for u in e.items]
    for u in found:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"upstream {name!r}: {u!r} is not an http(s) URL")
    kw: dict[str, Any] = {k: v for k, v in defaults.items() if v is not None}
    for key, value in e.options.items():
        try:
            kw[key] = _NUMBERS[key](value) if key in _NUMBERS else value
        except ValueError:
            raise ValueError(f"upstream {name!r}: option {key}={value!r} is not a number") from None
    api = kw.pop("api", None)  # parsed (UpstreamConfig.apis) after the checks before it
    cfg = UpstreamConfig(name=name, urls=tuple(u.removesuffix("/v1") for u in found), **kw)
    if cfg.eject_after < 1 or min(cfg.connect_timeout, cfg.read_timeout, cfg.health_interval, cfg.cooldown) <= 0:
        raise ValueError(f"upstream {name!r}: timeouts, intervals and eject_after must be positive")
    if cfg.slots is not None and cfg.slots < 1:
        raise ValueError(f"upstream {name!r}: slots must be >= 1")
    if api is not None:
        cfg = replace(cfg, api=api)
    if cfg.kv_events is not None and len(cfg.kv_events.split(",")) != len(cfg.urls):
        raise ValueError(f"upstream {name!r}: kv-events needs one publisher per URL ({len(cfg.urls)})")
    if cfg.plain not in ("direct", "stream"):
        raise ValueError(f"upstream {name!r}: plain={cfg.plain!r} is not one of direct, stream")
    return cfg


def _label(urls: str) -> str:
    """The name of an upstream given without one: its first URL's host:port."""
    first = urls.split(",")[0].strip()
    return urlsplit(first).netloc or first


class _CheckFailed(Exception):
    pass


class Upstream:
    """The URLs, breakers, health checks and HTTP session of one upstream."""

    def __init__(self, cfg: UpstreamConfig) -> None:
        self.cfg = cfg
        self.endpoints: list[Endpoint] = []
        self.max_model_len = cfg.max_model_len or 4096
        self._session: aiohttp.ClientSession | None = None
        self._users = 0
        self._health: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._pings: set[asyncio.Future[None]] = set()
        self._next = 0
        self.listeners: list[Callable[[], None]] = []  # discovery: called when what a URL lists changed
        # which usable URL (routing/policy.py); ids are positions in `endpoints`
        self.policy: RoutingPolicy = RoutingPolicy()
        # non-streamed calls: no read timeout (the silence watch bounds them)
        self.plain_timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout, sock_read=None)
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def acquire(self) -> None:
        self._users += 1
        if self._session is None:
            c = self.cfg
            if not self.endpoints:  # futures need the running loop
                self.endpoints = [Endpoint(u) for u in c.urls]
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=c.connect_timeout, sock_read=c.read_timeout),
                headers=self._headers,
            )
            # the first round of checks decides at once (a node that is down
            # at start is not tried first) and names each node's model id
            first = [self._check(ep, first=True) for ep in self.endpoints]
            await asyncio.wait([asyncio.ensure_future(f) for f in first], timeout=c.connect_timeout + 0.5)
            self._health = asyncio.ensure_future(self._health_loop())
            self._watch = asyncio.ensure_future(self._silence_loop())

    async def release(self) -> None:
        self._users -= 1
        if self._users > 0 or self._session is None:
            return
        tasks = [t for t in (self._health, self._watch, *self._pings) if t is not None]
        await cancel_and_wait(tasks)  # health loops use wait_for: cancel until done
        session, self._session = self._session, None
        await session.close()
        await self.policy.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise ServiceUnavailable(f"upstream {self.cfg.name!r} is not started", retry_after=1)
        return self._session

    def pick(
        self, exclude: Collection[Endpoint] = (), key: RouteKey | None = None, model: str | None = None
    ) -> Endpoint:
        """A usable URL (one that lists `model`, if given): with no key
        (least outstanding), the one with the fewest requests in flight
        (round robin on ties); else as the policy chooses among the usable
        ones. None: a refusal that names each URL's last error."""
        now, n, cd = time.monotonic(), len(self.endpoints), self.cfg.cooldown
        if not n:
            raise ServiceUnavailable(f"upstream {self.cfg.name!r} is not started", retry_after=1)
        self._next = (self._next + 1) % n
        best: Endpoint | None = None
        if key is None:
            for k in range(n):
                ep = self.endpoints[(self._next + k) % n]
                if (ep not in exclude and ep.usable(now, cd) and self.lists(ep, model)
                        and (best is None or ep.outstanding < best.outstanding)):
                    best = ep
            if best is not None and n > 1:
                self.policy.stats.decisions["least_outstanding"] += 1
        else:
            ids = [i for i, ep in enumerate(self.endpoints)
                   if ep not in exclude and ep.usable(now, cd) and self.lists(ep, model)]
            if ids:
                loads = [self.endpoints[i].outstanding for i in ids]
                slots = [self.cfg.slots or self.endpoints[i].slots for i in ids]
                best = self.endpoints[ids[self.policy.choose(ids, loads, key, slots)]]
        if best is None:
            raise self.refusal(model)
        if best.state_at(now, cd) == "half_open":
            best.state, best.trial = "half_open", True
            rearm(best)  # the breaker's ejection must not fail its trial at once
        return best

    def lists(self, ep: Endpoint, model: str | None) -> bool:
        """Whether `ep` serves `model` (a model or adapter id sent as is;
        None: the upstream's own). Before its first good check a URL of a
        named upstream is not ruled out; a discovering one's is."""
        if model is None:
            return True
        if self.cfg.discovers:
            return model in ep.models or model in ep.adapters
        return not ep.serves or model in ep.serves

    def refusal(self, model: str | None = None) -> ServiceUnavailable:
        """No URL takes the request now: why, in the client's message (each
        URL's last error), to be fixed without reading the gateway's log."""
        name = self.cfg.name
        if model is not None and not any(self.lists(ep, model) for ep in self.endpoints):
            return ServiceUnavailable(f"upstream {name!r}: no URL lists model {model!r} now",
                                      code="upstream_model_unlisted", retry_after=self.cfg.health_interval)
        causes = "; ".join(f"{ep.url}: {ep.last_error or 'breaker open'}" for ep in self.endpoints[:4]
                           if self.lists(ep, model))
        more = f" (and {len(self.endpoints) - 4} more)" if len(self.endpoints) > 4 else ""
        return ServiceUnavailable(f"upstream {name!r}: every URL is ejected: {causes}{more}",
                                  code="upstream_ejected", retry_after=self.cfg.cooldown)

    def model_for(self, ep: Endpoint, path: str = "") -> str:
        """The model id to send to `ep`: `;model=ID`, else what its
        /v1/models said (its embedding model for /v1/embeddings, where the
        node named it apart), else the served name."""
        if path == "/v1/embeddings" and ep.embed_id and not self.cfg.model:
            return ep.embed_id
        return self.cfg.model or ep.model_id or self.cfg.name

    def listed(self) -> dict[str, Card]:
        """Discovery: every model some URL listed at its last good check
        (down URLs included: a node that is down is a 503, not a 404)."""
        out: dict[str, Card] = {}
        for ep in self.endpoints:
            for mid, card in ep.models.items():
                out.setdefault(mid, card)
        return out

    def card_of(self, model: str) -> tuple[int, str]:
        """(max_model_len, kind) of a discovered model, as its nodes say."""
        cards = [ep.models[model] for ep in self.endpoints if model in ep.models]
        lens = [c["max_model_len"] for c in cards if isinstance(c.get("max_model_len"), int)]
        return (min(lens) if lens else self.cfg.max_model_len or 4096), kind(cards[0]) if cards else "generate"

    @property
    def apis(self) -> frozenset[str]:
        """The client APIs every URL serves: `;api=`, else what their
        /openapi.json showed (none until one was read)."""
        if self.cfg.apis is not None:
            return self.cfg.apis
        known = [ep.apis for ep in self.endpoints if ep.apis is not None]
        return frozenset.intersection(*known) if known else frozenset()

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "url": ep.url, "model": None if self.cfg.discovers else self.model_for(ep),
                "embedding_model": ep.embed_id, "serves": list(ep.serves), "healthy": ep.healthy,
                "breaker": ep.state_at(now, self.cfg.cooldown), "outstanding": ep.outstanding,
                "last_error": ep.last_error,
                "apis": sorted(self.cfg.apis if self.cfg.apis is not None else ep.apis or ()),
            }
            for ep in self.endpoints
        ]

    def succeeded(self, ep: Endpoint) -> None:
        ep.failures = 0
        if ep.state != "closed":
            logger.info("upstream %s %s: breaker closed", self.cfg.name, ep.url)
            ep.state = "closed"

    def failed(self, ep: Endpoint, why: str) -> None:
        ep.failures += 1
        ep.last_error = why
        if ep.state == "half_open" or (ep.state == "closed" and ep.failures >= self.cfg.eject_after):
            ep.state, ep.opened_at = "open", time.monotonic()
            ep.ejections += 1
            self._forget(ep)
            eject(ep)
            logger.warning(
                "upstream %s %s: breaker open for %.0fs after %d failures (%s)",
                self.cfg.name, ep.url, self.cfg.cooldown, ep.failures, why,
            )

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval)
            await asyncio.gather(*(self._check(ep) for ep in self.endpoints))

    async def _silence_loop(self) -> None:
        """Eject a URL that non-streamed calls wait on and that has sent
        nothing for `read_timeout`; ping it at half that."""
        limit = self.cfg.read_timeout
        tick = min(1.0, limit / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for ep in self.endpoints:
                if not ep.waiting or not ep.healthy:
                    continue
                quiet = now - max(ep.last_seen, ep.watch_from)
                if quiet > limit:
                    why = f"sent nothing for {limit:g}s while requests waited on it"
                    ep.healthy = False
                    ep.last_error = why
                    ep.ejections += 1
                    self._forget(ep)
                    eject(ep, "upstream_timeout")
                    logger.warning("upstream %s %s: ejected: %s", self.cfg.name, ep.url, why)
                elif quiet > limit / 2 and not ep.pinging:
                    ep.pinging = True
                    ping = asyncio.ensure_future(self._ping(ep, limit / 2))
                    self._pings.add(ping)
                    ping.add_done_callback(self._pings.discard)

    async def _ping(self, ep: Endpoint, limit: float) -> None:
        try:
            async with self.session.get(ep.url + "/health", timeout=aiohttp.ClientTimeout(total=limit)) as r:
                if r.status == 200:
                    ep.last_seen = time.monotonic()
        except (aiohttp.ClientError, *TIMEOUTS, ServiceUnavailable):
            pass
        finally:
            ep.pinging = False

    async def _check(self, ep: Endpoint, first: bool = False) -> None:
        c = self.cfg
        limit = min(c.health_interval, c.read_timeout, c.connect_timeout if first else c.read_timeout)
        timeout = aiohttp.ClientTimeout(total=limit)
        try:
            async with self.session.get(ep.url + "/health", timeout=timeout) as r:
                if r.status != 200:
                    raise _CheckFailed(f"/health answered {r.status}")
            async with self.session.get(ep.url + "/v1/models", timeout=timeout) as r:
                if r.status != 200:
                    raise _CheckFailed(f"/v1/models answered {r.status}")
                listing = read_listing(orjson.loads(await r.read()))
            ep.serves = listing.ids
            if c.discovers:
                self._relisted(ep, listing.models)
                if not listing.models:
                    raise NotListed("/v1/models lists no model")
                card = next(iter(listing.models.values()))
                ep.adapters = {a: root for a, (_, root) in listing.adapters.items()}
            else:
                chosen = choose(listing, c.name, c.model)
                card, ep.embed_id = chosen.card, chosen.embed_id
                ep.model_id = str(card["id"])
                ep.adapters = {a: root for a, (parent, root) in listing.adapters.items() if parent == card["id"]}
            slots = card.get("slots")  # npu-gateway nodes say it; vLLM's own server does not
            ep.slots = slots if isinstance(slots, int) and slots > 0 else 0
            if c.max_model_len is None and isinstance(card.get("max_model_len"), int) and not c.discovers:
                self.max_model_len = card["max_model_len"]
            if ep.apis is None and self.cfg.apis is None:
                await self._read_apis(ep, timeout)
        except (aiohttp.ClientError, *TIMEOUTS, ValueError, TypeError, AttributeError, _CheckFailed, GatewayError) as e:
            why = str(e) or type(e).__name__
            ep.check_failures += 1
            ep.last_error = why
            if first:
                logger.warning("upstream %s %s: %s", self.cfg.name, ep.url, why)
            if ep.healthy and (first or ep.check_failures >= self.cfg.eject_after):
                ep.healthy = False
                ep.ejections += 1
                self._forget(ep)
                eject(ep)
                logger.warning("upstream %s %s: ejected by health checks: %s", self.cfg.name, ep.url, why)
            return
        ep.last_seen = time.monotonic()
        if first and not c.discovers:
            also = f" (embeddings: {ep.embed_id!r})" if ep.embed_id else ""
            logger.info("upstream %s %s: serves model %r%s", self.cfg.name, ep.url, ep.model_id, also)
        ep.check_failures = 0
        if ep.last_error is not None and ep.last_error.startswith(LISTING_REASONS):
            ep.last_error = None
        if not ep.healthy:
            ep.healthy = True
            rearm(ep)
            logger.info("upstream %s %s: health checks pass again", self.cfg.name, ep.url)

    async def _read_apis(self, ep: Endpoint, timeout: aiohttp.ClientTimeout) -> None:
        """Which client APIs the node serves, from its /openapi.json (once;
        a node without one serves none of them; a failed read is retried at
        the next check)."""
        try:
            async with self.session.get(ep.url + "/openapi.json", timeout=timeout) as r:
                if r.status in (404, 405):
                    ep.apis = frozenset()
                elif r.status == 200:
                    ep.apis = apis_from_openapi(orjson.loads(await r.read()))
        except (aiohttp.ClientError, *TIMEOUTS, ValueError, AttributeError, KeyError) as e:
            logger.info("upstream %s %s: /openapi.json not read (%s)", self.cfg.name, ep.url, e)
            return
        if ep.apis is not None:
            logger.info("upstream %s %s: client APIs: %s", self.cfg.name, ep.url, ", ".join(sorted(ep.apis)) or "none")

    def _relisted(self, ep: Endpoint, models: dict[str, Card]) -> None:
        """Discovery: what `ep` lists now; each model that appeared or
        disappeared is logged, and the listeners hear of it."""
        gone = [m for m in ep.models if m not in models]
        new = [m for m in models if m not in ep.models]
        ep.models = dict(models)
        for m in new:
            logger.info("upstream %s %s: lists model %r: routable", self.cfg.name, ep.url, m)
        for m in gone:
            logger.warning("upstream %s %s: no longer lists model %r: it takes no traffic for it",
                           self.cfg.name, ep.url, m)
        if new or gone:
            for listener in list(self.listeners):
                try:
                    listener()
                except Exception:  # a listener must not stop the health checks
                    logger.exception("upstream %s: a listener of its models failed", self.cfg.name)

    def _forget(self, ep: Endpoint) -> None:
        """An ejected URL loses its routing entries: it may come back restarted."""
        if ep in self.endpoints:
            self.policy.forget(self.endpoints.index(ep))


def upstreams_of(pools: Iterable[Any]) -> list[Upstream]:
    """The distinct upstreams behind these WorkerPools' engines."""
    found: dict[int, Upstream] = {}
    for p in pools:
        for w in getattr(p, "workers", ()):
            up = getattr(w.engine, "upstream", None)
            if isinstance(up, Upstream):
                found.setdefault(id(up), up)
    return list(found.values())
