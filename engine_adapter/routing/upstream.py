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
  (the one model it serves, else the served name if the node lists it, else
  `;model=ID` must pick one) and its
  `max_model_len`. A node that does not serve the expected model is named
  in the log and in `/admin/routes`, with what it does serve.

- Client APIs: the first good check also reads the node's `/openapi.json`
  once, to learn which of the other client APIs it serves (Responses,
  Messages, count_tokens, /generate, TGI; engine_adapter/backends/api_relay.py),
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
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from engine_adapter.backends.api_relay import apis_from_openapi, parse_apis
from engine_adapter.entry import parse_entry
from engine_adapter.errors import GatewayError, ServiceUnavailable
from engine_adapter.routing.policy import RouteKey, RoutingPolicy
from engine_adapter.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

TIMEOUTS = (TimeoutError, asyncio.TimeoutError)
BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    name: str  # the served name here
    urls: tuple[str, ...]
    model: str | None = None  # the node's model id; default: learned from its /v1/models
    connect_timeout: float = 2.0
    read_timeout: float = 30.0  # longest silence: to the headers, between chunks
    health_interval: float = 5.0
    eject_after: int = 3
    cooldown: float = 10.0
    max_model_len: int | None = None  # default: the upstream's /v1/models
    api_key_env: str | None = None  # environment variable holding the upstream key
    api: str | None = None  # the client APIs the node serves (api_relay.API_NAMES); default: its /openapi.json
    plain: Literal["direct", "stream"] = "direct"  # how a non-streaming client's generation is called
    slots: int | None = None  # requests one URL runs at once (a routing hint); default: its /v1/models "slots"
    # --routing-policy kv-events: each URL's KV event publisher, in URL order, `PUB[|REPLAY]` comma-separated
    # (routing/kv_events.py remote_sources), and a local folder of the nodes' tokenizer to hash prompts with
    kv_events: str | None = None
    kv_tokenizer: str | None = None



_NUMBERS: dict[str, Callable[[str], float | int]] = {
    "connect_timeout": float, "read_timeout": float, "health_interval": float,
    "cooldown": float, "eject_after": int, "max_model_len": int, "slots": int,
}
_TEXTS = ("model", "api_key_env", "api", "plain", "kv_events", "kv_tokenizer")


def parse_upstream(spec: str, **defaults: Any) -> UpstreamConfig:
    """`NAME=URL[,URL...][;option=value...]`; options name UpstreamConfig fields."""
    e = parse_entry(spec, "upstream", "NAME=URL[,URL...][;option=value...]", options=(*_NUMBERS, *_TEXTS))
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
    cfg = UpstreamConfig(name=name, urls=tuple(u.removesuffix("/v1") for u in found), **kw)
    if cfg.eject_after < 1 or min(cfg.connect_timeout, cfg.read_timeout, cfg.health_interval, cfg.cooldown) <= 0:
        raise ValueError(f"upstream {name!r}: timeouts, intervals and eject_after must be positive")
    if cfg.slots is not None and cfg.slots < 1:
        raise ValueError(f"upstream {name!r}: slots must be >= 1")
    if cfg.api is not None:
        parse_apis(cfg.api, name)
    if cfg.kv_events is not None and len(cfg.kv_events.split(",")) != len(cfg.urls):
        raise ValueError(f"upstream {name!r}: kv-events needs one publisher per URL ({len(cfg.urls)})")
    if cfg.plain not in ("direct", "stream"):
        raise ValueError(f"upstream {name!r}: plain={cfg.plain!r} is not one of direct, stream")
    return cfg


@dataclass(slots=True)
class Endpoint:
    url: str
    outstanding: int = 0
    state: BreakerState = "closed"
    failures: int = 0  # request failures in a row
    opened_at: float = 0.0
    trial: bool = False  # a half-open trial request is in flight
    healthy: bool = True  # the active health checks' verdict
    model_id: str | None = None  # the node's model id, from its /v1/models
    serves: tuple[str, ...] = ()  # every model id the node listed
    adapters: dict[str, str] = field(default_factory=dict)  # its LoRA adapters (parent: its model): id -> root
    apis: frozenset[str] | None = None  # the client APIs its /openapi.json shows (None: not read yet)
    ejected: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    check_failures: int = 0
    ejections: int = 0
    last_error: str | None = None
    last_seen: float = field(default_factory=time.monotonic)  # the last byte from it
    waiting: int = 0  # non-streamed calls waiting for their answer
    watch_from: float = 0.0  # when the waiting began (silence counts from it or the last byte)
    pinging: bool = False
    slots: int = 0  # the requests it runs at once, from its /v1/models card (0: it does not say)

    def state_at(self, now: float, cooldown: float) -> BreakerState:
        if self.state == "open" and now - self.opened_at >= cooldown:
            return "half_open"
        return self.state

    def usable(self, now: float, cooldown: float) -> bool:
        state = self.state_at(now, cooldown)
        return self.healthy and (state == "closed" or (state == "half_open" and not self.trial))


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

    def pick(self, exclude: Collection[Endpoint] = (), key: RouteKey | None = None) -> Endpoint:
        """A usable URL: with no key (least outstanding), the one with the
        fewest requests in flight (round robin on ties); else as the policy
        chooses among the usable ones."""
        now, n, cd = time.monotonic(), len(self.endpoints), self.cfg.cooldown
        if not n:
            raise ServiceUnavailable(f"upstream {self.cfg.name!r} is not started", retry_after=1)
        self._next = (self._next + 1) % n
        best: Endpoint | None = None
        if key is None:
            for k in range(n):
                ep = self.endpoints[(self._next + k) % n]
                if ep not in exclude and ep.usable(now, cd) and (best is None or ep.outstanding < best.outstanding):
                    best = ep
            if best is not None and n > 1:
                self.policy.stats.decisions["least_outstanding"] += 1
        else:
            ids = [i for i, ep in enumerate(self.endpoints) if ep not in exclude and ep.usable(now, cd)]
            if ids:
                loads = [self.endpoints[i].outstanding for i in ids]
                slots = [self.cfg.slots or self.endpoints[i].slots for i in ids]
                best = self.endpoints[ids[self.policy.choose(ids, loads, key, slots)]]
        if best is None:
            raise ServiceUnavailable(
                f"upstream {self.cfg.name!r}: every URL is ejected (failing requests or health checks)",
                code="upstream_ejected", retry_after=cd,
            )
        if best.state_at(now, cd) == "half_open":
            best.state, best.trial = "half_open", True
            _rearm(best)  # the breaker's ejection must not fail its trial at once
        return best

    def model_for(self, ep: Endpoint) -> str:
        """The model id to send to `ep`: `;model=ID`, else what its
        /v1/models said, else the served name."""
        return self.cfg.model or ep.model_id or self.cfg.name

    @property
    def apis(self) -> frozenset[str]:
        """The client APIs every URL serves: `;api=`, else what their
        /openapi.json showed (none until one was read)."""
        if self.cfg.api is not None:
            return parse_apis(self.cfg.api, self.cfg.name)
        known = [ep.apis for ep in self.endpoints if ep.apis is not None]
        return frozenset.intersection(*known) if known else frozenset()

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "url": ep.url, "model": self.model_for(ep), "serves": list(ep.serves), "healthy": ep.healthy,
                "breaker": ep.state_at(now, self.cfg.cooldown), "outstanding": ep.outstanding,
                "last_error": ep.last_error,
                "apis": sorted(parse_apis(self.cfg.api, self.cfg.name) if self.cfg.api is not None else ep.apis or ()),
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
            _eject(ep)
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
                    _eject(ep, "upstream_timeout")
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
                data = orjson.loads(await r.read())
            cards = [m for m in data.get("data", ()) if isinstance(m, dict) and m.get("id")]
            ep.serves = tuple(str(m["id"]) for m in cards)
            card = self._pick_model(cards)
            ep.model_id = str(card["id"])
            ep.adapters = {str(m["id"]): str(m.get("root") or m["id"]) for m in cards if m.get("parent") == card["id"]}
            slots = card.get("slots")  # npu-gateway nodes say it; vLLM's own server does not
            ep.slots = slots if isinstance(slots, int) and slots > 0 else 0
            if self.cfg.max_model_len is None and isinstance(card.get("max_model_len"), int):
                self.max_model_len = card["max_model_len"]
            if ep.apis is None and self.cfg.api is None:
                await self._read_apis(ep, timeout)
        except (aiohttp.ClientError, *TIMEOUTS, ValueError, AttributeError, _CheckFailed, GatewayError) as e:
            why = str(e) or type(e).__name__
            ep.check_failures += 1
            ep.last_error = why
            if first:
                logger.warning("upstream %s %s: %s", self.cfg.name, ep.url, why)
            if ep.healthy and (first or ep.check_failures >= self.cfg.eject_after):
                ep.healthy = False
                ep.ejections += 1
                self._forget(ep)
                _eject(ep)
                logger.warning("upstream %s %s: ejected by health checks: %s", self.cfg.name, ep.url, why)
            return
        ep.last_seen = time.monotonic()
        if first:
            logger.info("upstream %s %s: serves model %r", self.cfg.name, ep.url, ep.model_id)
        ep.check_failures = 0
        if ep.last_error is not None and ep.last_error.startswith(("does not serve", "serves several")):
            ep.last_error = None
        if not ep.healthy:
            ep.healthy = True
            _rearm(ep)
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

    def _forget(self, ep: Endpoint) -> None:
        """An ejected URL loses its routing entries: it may come back restarted."""
        if ep in self.endpoints:
            self.policy.forget(self.endpoints.index(ep))

    def _pick_model(self, cards: list[dict[str, Any]]) -> dict[str, Any]:
        ids = [str(m["id"]) for m in cards]
        if self.cfg.model is None:  # a LoRA adapter (a card whose parent is listed too) is not a choice
            cards = [m for m in cards if m.get("parent") not in ids] or cards
        if self.cfg.model is not None:
            for m in cards:
                if m["id"] == self.cfg.model:
                    return m
            raise _CheckFailed(f"does not serve {self.cfg.model!r} (it serves {', '.join(ids) or 'nothing'})")
        if len(cards) == 1:
            return cards[0]
        for m in cards:  # NAME=URL where NAME is one of the node's ids
            if m["id"] == self.cfg.name:
                return m
        if not cards:
            raise _CheckFailed("does not serve any model (/v1/models is empty)")
        raise _CheckFailed(f"serves several models ({', '.join(ids)}): pick one with ;model=ID")


def _eject(ep: Endpoint, code: str = "upstream_ejected") -> None:
    """Fail the requests waiting on `ep` for their first byte."""
    if not ep.ejected.done():
        ep.ejected.set_result(code)


def _rearm(ep: Endpoint) -> None:
    """`ep` takes requests again (health checks pass, or its breaker lets a
    trial through): a new ejection will fail the ones waiting on it then."""
    if ep.ejected.done():
        ep.ejected = asyncio.get_running_loop().create_future()


def upstreams_of(pools: Iterable[Any]) -> list[Upstream]:
    """The distinct upstreams behind these WorkerPools' engines."""
    found: dict[int, Upstream] = {}
    for p in pools:
        for w in getattr(p, "workers", ()):
            up = getattr(w.engine, "upstream", None)
            if isinstance(up, Upstream):
                found.setdefault(id(up), up)
    return list(found.values())
