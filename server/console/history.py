"""What the console remembers of finished requests, in this process only:
the last requests (no prompt or output ever reaches here: the records are
the access log's) and one hour of latency and throughput in 10 s buckets.

Both are fed from the per-request record (`Memory.record`, one of the
middleware's record sinks: server/middleware.py) and bounded: `Recent`
keeps `size` records; `History` keeps one bucket per `bucket_s` for
`span_s` seconds, at most `max_samples` latency samples per bucket while
the bucket is open (a uniform reservoir), and only percentiles once it is
closed.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Not requests the console reports on: its own polling, scrapes, probes.
SKIP_PREFIXES = ("/console", "/metrics", "/health", "/ready", "/admin", "/docs", "/openapi.json", "/favicon.ico")
# The fields of a record the console shows (the access log's, less nothing
# secret: a key appears by name only, bodies never).
RECENT_FIELDS = (
    "time", "request_id", "key", "method", "endpoint", "model", "target", "status", "prompt_tokens",
    "completion_tokens", "cached_tokens", "queue_wait", "ttft", "duration", "client",
)
QUANTILES = (0.5, 0.9, 0.99)
RECENT_WINDOW = 300.0  # seconds behind the headline percentiles


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def wanted(rec: Mapping[str, Any]) -> bool:
    endpoint = rec.get("endpoint") or ""
    return not str(endpoint).startswith(SKIP_PREFIXES)


class Recent:
    """The last `size` requests, newest first when read. The records are
    kept as they came (a reference: the request path copies nothing) and
    cut down to RECENT_FIELDS when read."""

    def __init__(self, size: int = 200) -> None:
        self._items: deque[Mapping[str, Any]] = deque(maxlen=size)
        self.seen = 0

    def add(self, rec: Mapping[str, Any]) -> None:
        self._items.append(rec)
        self.seen += 1

    def items(self, limit: int | None = None) -> list[dict[str, Any]]:
        out = [{k: rec.get(k) for k in RECENT_FIELDS} for rec in reversed(self._items)]
        return out if limit is None else out[:limit]


@dataclass(slots=True)
class _Samples:
    """A reservoir of at most `cap` values out of `n` offered."""

    cap: int
    values: list[float] = field(default_factory=list)
    n: int = 0

    def add(self, v: float, rng: random.Random) -> None:
        self.n += 1
        if len(self.values) < self.cap:
            self.values.append(v)
        else:
            i = int(rng.random() * self.n)  # uniform in [0, n): randrange costs 3x more
            if i < self.cap:
                self.values[i] = v

    def summary(self) -> list[float] | None:
        if not self.values:
            return None
        s = sorted(self.values)
        return [percentile(s, q) for q in QUANTILES]


@dataclass(slots=True)
class _Bucket:
    index: int  # int(time // bucket_s)
    ttft: _Samples
    itl: _Samples
    requests: int = 0
    errors: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    closed: tuple[list[float] | None, list[float] | None] | None = None

    def close(self) -> None:
        if self.closed is None:
            self.closed = (self.ttft.summary(), self.itl.summary())
            self.ttft.values, self.itl.values = [], []

    def quantiles(self) -> tuple[list[float] | None, list[float] | None]:
        return self.closed if self.closed is not None else (self.ttft.summary(), self.itl.summary())


class History:
    """TTFT and ITL percentiles, requests, errors and tokens per bucket."""

    def __init__(
        self,
        bucket_s: float = 10.0,
        span_s: float = 3600.0,
        max_samples: int = 512,
        recent_samples: int = 4096,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if bucket_s <= 0 or span_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= span_s")
        self.bucket_s = bucket_s
        self.n_buckets = int(span_s // bucket_s)
        self.max_samples = max_samples
        self._clock = clock
        self._buckets: deque[_Bucket] = deque(maxlen=self.n_buckets)
        self._rng = random.Random()
        # the last few minutes' samples as they came (the headline numbers)
        self._latest: deque[tuple[float, float, float | None]] = deque(maxlen=recent_samples)
        self._tokens: deque[tuple[float, int]] = deque(maxlen=recent_samples)

    def _bucket(self, now: float) -> _Bucket:
        index = int(now // self.bucket_s)
        if self._buckets and self._buckets[-1].index == index:
            return self._buckets[-1]
        if self._buckets:
            self._buckets[-1].close()
        b = _Bucket(index, _Samples(self.max_samples), _Samples(self.max_samples))
        self._buckets.append(b)
        return b

    def add(self, rec: Mapping[str, Any], now: float | None = None) -> None:
        """One finished request (an access-log record)."""
        now = self._clock() if now is None else now
        b = self._bucket(now)
        b.requests += 1
        status = rec.get("status") or 0
        if status >= 400:
            b.errors += 1
        completion = rec.get("completion_tokens") or 0
        b.completion_tokens += completion
        if completion:
            self._tokens.append((now, completion))
        b.prompt_tokens += rec.get("prompt_tokens") or 0
        ttft = rec.get("ttft")
        if status != 200 or ttft is None:
            return
        b.ttft.add(float(ttft), self._rng)
        duration = rec.get("duration")
        itl = None
        if completion >= 2 and duration is not None:
            # mean inter-token latency of the request: the time after its
            # first token over the tokens that followed it
            itl = max(0.0, float(duration) - float(ttft)) / (completion - 1)
            b.itl.add(itl, self._rng)
        self._latest.append((now, float(ttft), itl))

    def latest(self, now: float, window_s: float = RECENT_WINDOW) -> dict[str, Any]:
        """Percentiles over the last `window_s` seconds' requests (up to
        `recent_samples` of them)."""
        ttfts = sorted(t for at, t, _ in self._latest if now - at <= window_s)
        itls = sorted(i for at, _, i in self._latest if now - at <= window_s and i is not None)
        return {
            "window_seconds": window_s,
            "requests": len(ttfts),
            "ttft_p50": percentile(ttfts, 0.5) if ttfts else None,
            "ttft_p99": percentile(ttfts, 0.99) if ttfts else None,
            "itl_p50": percentile(itls, 0.5) if itls else None,
        }

    def tokens_per_second(self, now: float, window_s: float = 60.0) -> float:
        """Completion tokens of the requests that ended in the last `window_s` s, per second."""
        return round(sum(n for at, n in self._tokens if now - at <= window_s) / window_s, 3)

    def series(self, now: float | None = None) -> dict[str, Any]:
        """Every bucket of the last span, oldest first (empty ones too: the
        plots show the whole hour). Percentiles are null where a bucket had
        no sample; tokens/s of the open bucket is over its elapsed part."""
        now = self._clock() if now is None else now
        last = int(now // self.bucket_s)
        first = last - self.n_buckets + 1
        by_index = {b.index: b for b in self._buckets if b.index >= first}
        t: list[float] = []
        ttft: list[list[float | None]] = [[] for _ in QUANTILES]
        itl: list[list[float | None]] = [[] for _ in QUANTILES]
        tps: list[float] = []
        requests: list[int] = []
        errors: list[int] = []
        totals = {"requests": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0}
        for i in range(first, last + 1):
            t.append(i * self.bucket_s)
            b = by_index.get(i)
            q_ttft, q_itl = b.quantiles() if b is not None else (None, None)
            for j in range(len(QUANTILES)):
                ttft[j].append(q_ttft[j] if q_ttft is not None else None)
                itl[j].append(q_itl[j] if q_itl is not None else None)
            span = self.bucket_s if i < last else max(1.0, now - i * self.bucket_s)
            tps.append(round(b.completion_tokens / span, 3) if b is not None else 0.0)
            requests.append(b.requests if b is not None else 0)
            errors.append(b.errors if b is not None else 0)
            if b is not None:
                totals["requests"] += b.requests
                totals["errors"] += b.errors
                totals["prompt_tokens"] += b.prompt_tokens
                totals["completion_tokens"] += b.completion_tokens
        names = [f"p{round(q * 100)}" for q in QUANTILES]
        return {
            "object": "console.history",
            "bucket_seconds": self.bucket_s,
            "t": t,
            "ttft": dict(zip(names, ttft, strict=True)),
            "itl": dict(zip(names, itl, strict=True)),
            "tokens_per_second": tps,
            "requests": requests,
            "errors": errors,
            "totals": totals,
            "recent": self.latest(now),
            "last_minute_tokens_per_second": self.tokens_per_second(now),
        }


class Memory:
    """The recent requests and the latency history, fed by `record`: the
    console's per-request record sink."""

    def __init__(self) -> None:
        self.recent = Recent()
        self.history = History()

    def record(self, rec: Mapping[str, Any]) -> None:
        """One finished request's access-log record (never a body)."""
        if wanted(rec):
            self.recent.add(rec)
            self.history.add(rec)
