"""bench/soak.py's flat-count goal: a count that follows the requests in
flight is not a leak; one that grows with time is, whatever the load does."""

from __future__ import annotations

import random
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import soak  # noqa: E402  # bench/soak.py


def _load(n: int, seed: int = 1) -> tuple[list[float], list[float]]:
    rnd = random.Random(seed)
    ts = [30.0 * i for i in range(n)]
    # open-loop arrivals: quiet first half, busier second half
    inflight = [float(rnd.randint(1, 10) + (15 if i > n // 2 else 0)) for i in range(n)]
    return ts, inflight


def test_tasks_that_follow_the_load_are_flat() -> None:
    ts, inflight = _load(110)
    tasks = [10 + 4 * r for r in inflight]
    g = soak.flat(ts, tasks, 10, inflight=inflight)
    assert g["raw_growth"] > 10  # the plain trend would call it a leak
    assert abs(g["growth"]) < 1 and g["ok"]
    assert g["per_request"] == 4


def test_a_leak_shows_whatever_the_load() -> None:
    ts, inflight = _load(110)
    leaked = [10 + 4 * r + 0.5 * i for i, r in enumerate(inflight)]  # one task a minute
    g = soak.flat(ts, leaked, 10, inflight=inflight)
    assert g["growth"] > 50 and not g["ok"]


def test_without_requests_in_flight_the_plain_trend_is_read() -> None:
    ts, _ = _load(20)
    g = soak.flat(ts, [float(i) for i in range(20)], 10)
    assert g["growth"] == 19.0 and "raw_growth" not in g and not g["ok"]
