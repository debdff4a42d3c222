"""Per-key limits shared by every gateway process through Valkey/Redis
(`--state-url`): requests and tokens per minute as a sliding window,
`max_concurrent` as leases with a TTL, budgets' running totals.

One admission decision is one round trip: the `ADMIT` script below trims
the key's windows, checks the three limits and, if all hold, records the
request and its lease, in one atomic step on the server (its clock: the
replicas' clocks never meet). Keys of one API key share a hash tag
(`npugw:{name}:...`), so they live in one slot of a cluster too.

Leases carry an expiry (`--state-lease-ttl`), renewed every third of it
while their request runs; a SIGKILLed replica's leases lapse within one
TTL. The end of a request settles its token reservation to the real count
and drops its lease (off the request path, in the background).

The store down or slow (`--state-timeout`): `available()` turns False, a
probe pings every second, and admission falls back as `--state-fail`
says (server/limits.py). A key in the store that another program wrote
with a value that does not parse is treated as absent (the script
deletes it and reports it; it is logged), never an error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from server.usage.budgets import BudgetBook

logger = logging.getLogger(__name__)

PREFIX = "npugw"
PROBE_INTERVAL = 1.0
BUDGET_INTERVAL = 0.5  # seconds between the budgets' exchanges with the store
BUDGET_TTL = 40 * 86400  # a month's totals outlive the month
WARN_INTERVAL = 60.0

# KEYS: window (zset id -> ms), tokens (hash id -> n, plus field "sum"), leases (zset id -> expiry ms)
# ARGV: rpm, tpm, max_concurrent, tokens, id, lease ttl ms, window ms
# -> {ok (1/0), why (0 none, 1 rpm, 2 tpm, 3 concurrency, 4 tpm: more than the limit),
#     retry ms, requests in window, token sum, ms until the oldest request leaves,
#     ms until the oldest token record leaves, leases, bad values fixed}
ADMIT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local need, id, ttl, win = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local bad = 0
local function fix(key, kind)
  local ty = redis.call('TYPE', key).ok
  if ty ~= 'none' and ty ~= kind then redis.call('DEL', key); bad = bad + 1 end
end
fix(KEYS[1], 'zset'); fix(KEYS[2], 'hash'); fix(KEYS[3], 'zset')
local cut = now - win
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cut)
local sum = tonumber(redis.call('HGET', KEYS[2], 'sum') or '0')
if sum == nil then sum = 0; bad = bad + 1 end
for _, m in ipairs(old) do
  local v = tonumber(redis.call('HGET', KEYS[2], m) or '0')
  if v == nil then bad = bad + 1; v = 0 end
  sum = sum - v
  redis.call('HDEL', KEYS[2], m)
end
if #old > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cut) end
if sum < 0 then sum = 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
local leases = redis.call('ZCARD', KEYS[3])
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local oldest = win
if first[2] then
  local s = tonumber(first[2])
  if s == nil then bad = bad + 1 else oldest = s + win - now end
end
local why, retry = 0, 0
if rpm > 0 and n >= rpm then why, retry = 1, oldest
elseif tpm > 0 and sum + need > tpm then
  if need > tpm then why, retry = 4, win else why, retry = 2, oldest end
elseif conc > 0 and leases >= conc then
  why = 3
  local soon = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  retry = 1000
  if soon[2] then retry = math.min(1000, tonumber(soon[2]) - now) end
end
if why == 0 then
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('HSET', KEYS[2], id, need)
  sum = sum + need
  n = n + 1
  if n == 1 then oldest = win end
  if conc > 0 then
    redis.call('ZADD', KEYS[3], now + ttl, id)
    leases = leases + 1
    redis.call('PEXPIRE', KEYS[3], ttl * 2)
  end
end
redis.call('HSET', KEYS[2], 'sum', sum)
redis.call('PEXPIRE', KEYS[1], win + 1000)
redis.call('PEXPIRE', KEYS[2], win + 1000)
return {why == 0 and 1 or 0, why, retry, n, sum, oldest, oldest, leases, bad}
"""

# KEYS: tokens hash, leases zset. ARGV: id, real tokens. Settles and releases.
SETTLE = """
local was = redis.call('HGET', KEYS[1], ARGV[1])
if was then
  local v, sum = tonumber(was), tonumber(redis.call('HGET', KEYS[1], 'sum') or '0')
  if v ~= nil and sum ~= nil then
    local now = sum + tonumber(ARGV[2]) - v
    if now < 0 then now = 0 end
    redis.call('HSET', KEYS[1], 'sum', now)
  end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return redis.call('ZREM', KEYS[2], ARGV[1])
"""

# KEYS: lease zsets; ARGV: ttl ms, then one id per key. Pushes expiries out.
RENEW = """
local t = redis.call('TIME')
local until_ = t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1])
local n = 0
for i, key in ipairs(KEYS) do
  n = n + redis.call('ZADD', KEYS[i], 'XX', 'CH', until_, ARGV[i + 1])
  redis.call('PEXPIRE', key, tonumber(ARGV[1]) * 2)
end
return n
"""


def redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


@dataclass(frozen=True, slots=True)
class Decision:
    ok: bool
    why: int  # 0 admitted, 1 rpm, 2 tpm, 3 concurrency, 4 the request alone is over tpm
    retry: float  # seconds
    requests: int  # in the window, this one included when admitted
    token_sum: int
    requests_reset: float  # seconds until the oldest request leaves the window
    tokens_reset: float
    leases: int


@dataclass(frozen=True, slots=True)
class Hold:
    """An admitted request's record in the store."""

    name: str
    id: str
    leased: bool
    reserved: int  # tokens charged at admission; 0 when the key has no tokens_per_minute


def _keys(name: str) -> tuple[str, str, str]:
    tag = "{" + name.replace("}", "_") + "}"
    return f"{PREFIX}:{tag}:w", f"{PREFIX}:{tag}:t", f"{PREFIX}:{tag}:l"


class StateStore:
    """The async client, its scripts, and whether the store answers."""

    def __init__(self, url: str, timeout: float = 0.25, lease_ttl: float = 10.0,
                 registry: CollectorRegistry | None = None) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        self.url = url
        self.timeout = timeout
        self.lease_ttl = lease_ttl
        self.client: Any = aioredis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True,
            max_connections=256,
            # One retry at once on a broken connection: a pooled connection that
            # a restarted store closed fails once, and the retry takes a new one.
            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError],
        )
        self._admit = self.client.register_script(ADMIT)
        self._settle = self.client.register_script(SETTLE)
        self._renew = self.client.register_script(RENEW)
        self.up = False
        self.leases: dict[str, str] = {}  # id -> lease key, renewed while they run
        self._tasks: set[asyncio.Task[Any]] = set()
        self._probe: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._budget_task: asyncio.Task[None] | None = None
        self.budgets: BudgetBook | None = None
        self._to_add: defaultdict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
        self._last_warning = -WARN_INTERVAL
        self._closed = False
        self.errors = Counter("npugw_state_store_errors", "Calls to the shared state store that failed or timed out.",
                              ["op"], registry=registry)
        if registry is not None:
            registry.register(_UpCollector(self))

    # ---- life ----
    async def start(self) -> None:
        if await self.ping():
            logger.info("shared limits in %s", redacted(self.url))
        else:
            self.down("start", None)
        self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())
        if self.budgets is not None:
            self._budget_task = asyncio.get_running_loop().create_task(self._budget_loop())

    def attach_budgets(self, book: BudgetBook) -> None:
        """Share `book`'s running totals through the store (before `start`)."""
        self.budgets = book
        book.share = self.add_usage

    async def close(self) -> None:
        self._closed = True
        if self._budget_task is not None:
            await self._exchange_budgets()  # the last records out
        loops = [t for t in (self._probe, self._renewer, self._budget_task) if t is not None]
        for t in loops:
            t.cancel()  # (a cancel that lands inside the client's connect may be absorbed: `_closed` ends it too)
        if loops or self._tasks:
            await asyncio.wait([*loops, *self._tasks], timeout=PROBE_INTERVAL + self.timeout * 4)
        await self.client.aclose()

    def available(self) -> bool:
        return self.up

    async def ping(self) -> bool:
        try:
            await asyncio.wait_for(self.client.ping(), self.timeout * 2)
        except Exception as e:
            self.errors.labels("ping").inc()
            logger.debug("state store ping failed: %s", e)
            return False
        self.up = True
        return True

    def down(self, op: str, err: BaseException | None) -> None:
        """A call failed: count it, warn at most once a minute, probe until it answers."""
        self.errors.labels(op).inc()
        was, self.up = self.up, False
        now = time.monotonic()
        if now - self._last_warning >= WARN_INTERVAL:
            self._last_warning = now
            logger.warning("shared state store %s does not answer (%s: %s); limits are per process until it does",
                           redacted(self.url), op, err if err is not None else "no answer")
        if not self._closed and (was or self._probe is None or self._probe.done()):
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        # Pooled connections made before the failure would each fail once more
        # after the store is back (a restarted server closed them): drop them all.
        try:
            await self.client.connection_pool.disconnect()
        except Exception as e:
            logger.debug("state store: dropping pooled connections: %s", e)
        while not await self.ping():
            if self._closed:
                return
            await asyncio.sleep(PROBE_INTERVAL)
        logger.warning("shared state store %s answers again: limits are shared", redacted(self.url))

    # ---- admission ----
    async def admit(
        self, name: str, rpm: int, tpm: int, conc: int, tokens: int, window: float
    ) -> tuple[Decision, Hold]:
        """One round trip. Raises on a store failure (the caller falls back)."""
        rid = os.urandom(12).hex()
        keys = _keys(name)
        try:
            r = await asyncio.wait_for(
                self._admit(keys=list(keys), args=[rpm, tpm, conc, tokens, rid, int(self.lease_ttl * 1000),
                                                   int(window * 1000)]),
                self.timeout,
            )
        except Exception as e:
            self.down("admit", e)
            raise
        if int(r[8]):
            logger.warning("state store: %d value(s) of key %r did not parse; treated as absent", int(r[8]), name)
        d = Decision(ok=bool(int(r[0])), why=int(r[1]), retry=max(0.0, int(r[2]) / 1000), requests=int(r[3]),
                     token_sum=int(float(r[4])), requests_reset=max(0.0, int(r[5]) / 1000),
                     tokens_reset=max(0.0, int(r[6]) / 1000), leases=int(r[7]))
        hold = Hold(name, rid, leased=d.ok and conc > 0, reserved=tokens if tpm else 0)
        if hold.leased:
            self.leases[rid] = keys[2]
        return d, hold

    def settle(self, hold: Hold, tokens: int) -> None:
        """The request ended: its real token count, its lease freed (in the background)."""
        self.leases.pop(hold.id, None)
        if not hold.leased and (not hold.reserved or tokens == hold.reserved):
            return  # nothing to release, nothing to correct: no round trip
        _, tok, lease = _keys(hold.name)
        self._spawn(self._call_settle([tok, lease], [hold.id, tokens]))

    async def _call_settle(self, keys: list[str], args: list[Any]) -> None:
        if not self.up:
            return  # the lease lapses by its TTL; the reservation stays as charged
        try:
            await asyncio.wait_for(self._settle(keys=keys, args=args), self.timeout * 4)
        except Exception as e:
            self.down("settle", e)

    async def _renew_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.lease_ttl / 3)
            if not self.leases or not self.up:
                continue
            ids, keys = list(self.leases), list(self.leases.values())
            try:
                await asyncio.wait_for(self._renew(keys=keys, args=[int(self.lease_ttl * 1000), *ids]),
                                       self.timeout * 4)
            except Exception as e:
                self.down("renew", e)

    # ---- budgets' running totals ----
    def add_usage(self, key: str, day: int, requests: int, tokens: int) -> None:
        slot = self._to_add[(key, day)]
        slot[0] += requests
        slot[1] += tokens

    async def _budget_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(BUDGET_INTERVAL)
            await self._exchange_budgets()

    async def _exchange_budgets(self) -> None:
        """Add this process's new records, read every replica's totals of the
        tracked keys for this month: one pipelined round trip."""
        book = self.budgets
        if book is None or not self.up:
            return
        from server.usage.periods import month_days

        first, _ = month_days(time.time())
        adds, self._to_add = self._to_add, defaultdict(lambda: [0, 0])
        keys = book.tracked
        if not adds and not keys:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for (key, day), (r, t) in adds.items():
                h = _budget_key(key, _month_of(day, first))
                pipe.hincrby(h, f"{day}:r", r)
                pipe.hincrby(h, f"{day}:t", t)
                pipe.expire(h, BUDGET_TTL)
            for key in keys:
                pipe.hgetall(_budget_key(key, first))
            out = await asyncio.wait_for(pipe.execute(raise_on_error=False), self.timeout * 4)
        except Exception as e:
            for k, (r, t) in adds.items():  # again next time
                self.add_usage(*k, r, t)
            self.down("budgets", e)
            return
        if any(isinstance(r, Exception) for r in out[: len(out) - len(keys)]):
            logger.warning("state store: a budget total did not take an addition (another program wrote it?)")
        shared: dict[str, dict[int, list[int]]] = {}
        for key, fields in zip(keys, out[len(out) - len(keys):], strict=True):
            days: dict[int, list[int]] = {}
            if isinstance(fields, Exception):
                logger.warning("state store: the budget totals of key %r did not parse (%s); treated as absent",
                               key, fields)
                fields = {}
            for field, value in fields.items():
                try:
                    day_s, kind = str(field).split(":")
                    slot = days.setdefault(int(day_s), [0, 0])
                    slot[0 if kind == "r" else 1] = int(value)
                except ValueError:
                    logger.warning("state store: budget total %s=%r of key %r did not parse; ignored",
                                   field, value, key)
            shared[key] = days
        book.shared = shared

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _budget_key(name: str, month_first_day: int) -> str:
    return f"{PREFIX}:{{{name.replace('}', '_')}}}:b:{month_first_day}"


def _month_of(day: int, this_month_first: int) -> int:
    """The first day of `day`'s month (days since 1970)."""
    if day >= this_month_first:
        return this_month_first
    from server.usage.periods import DAY, month_days

    return month_days(day * DAY)[0]


class _UpCollector(Collector):
    def __init__(self, store: StateStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("npugw_state_store_up", "1 when the shared state store (--state-url) answers.")
        g.add_metric([], 1.0 if self.store.up else 0.0)
        yield g
