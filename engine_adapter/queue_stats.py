"""What a WorkerPool's queue measures: the wait per tenant, refusals per
tenant and reason, the service rate the wait estimate divides by, and how
far off that estimate was. Plain counters read at scrape time
(server/queueing.py exports them); the request path only adds to them."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(slots=True)
class Histogram:
    """Counts per upper bound (not cumulative), a sum and a count."""

    bounds: tuple[float, ...] = WAIT_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # the last one: +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, count at or below it)."""
        out, running = [], 0
        for bound, c in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += c
            out.append((bound, running))
        return out


class ServiceRate:
    """Work served per second while the pool is saturated (every slot taken
    or a queue waiting), in the queue's cost units. Only busy stretches
    count, so idle time does not lower it; older stretches fade (each new
    one weighs `1 - decay`)."""

    def __init__(self, decay: float = 0.95, min_samples: int = 4) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self._cost = 0.0
        self._time = 0.0
        self._samples = 0
        self._last: float | None = None

    def served(self, now: float, cost: float, busy: bool) -> None:
        """A slot was released at `now` after work of `cost`; `busy`: the
        pool was saturated just before."""
        if busy and self._last is not None and now > self._last:
            self._cost = self._cost * self.decay + cost
            self._time = self._time * self.decay + (now - self._last)
            self._samples += 1
        self._last = now if busy else None

    @property
    def per_second(self) -> float | None:
        """Cost units per second; None until measured."""
        if self._samples < self.min_samples or self._time <= 0:
            return None
        return self._cost / self._time


@dataclass(slots=True)
class QueueStats:
    wait: dict[str, Histogram] = field(default_factory=dict)  # tenant -> queue wait (s)
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, reason)
    estimate_error: Histogram = field(default_factory=Histogram)  # |actual - estimated| wait (s)
    estimate_bias: float = 0.0  # sum of (actual - estimated): > 0, the estimate is low
    rate: ServiceRate = field(default_factory=ServiceRate)
    # requests admitted into a reserve slot (--fair-reserve-slots), by reason:
    # new_flow, priority (engine_adapter/admission.py)
    reserve_admitted: Counter[str] = field(default_factory=Counter)

    def waited(self, tenant: str, seconds: float) -> None:
        h = self.wait.get(tenant)
        if h is None:
            h = self.wait[tenant] = Histogram()
        h.observe(seconds)

    def estimated(self, estimate: float, actual: float) -> None:
        self.estimate_error.observe(abs(actual - estimate))
        self.estimate_bias += actual - estimate
