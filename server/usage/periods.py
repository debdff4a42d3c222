"""UTC days and months as the ledger counts them."""

from __future__ import annotations

import time
from datetime import datetime, timezone

DAY = 86400


def day_of(ts: float) -> int:
    """Days since 1970-01-01 (UTC)."""
    return int(ts // DAY)


def month_days(ts: float) -> tuple[int, int]:
    """The first day of `ts`'s month and the first day of the next one."""
    t = time.gmtime(ts)
    start = datetime(t.tm_year, t.tm_mon, 1, tzinfo=timezone.utc)
    nxt = datetime(t.tm_year + (t.tm_mon == 12), t.tm_mon % 12 + 1, 1, tzinfo=timezone.utc)
    return day_of(start.timestamp()), day_of(nxt.timestamp())


def iso(ts: float) -> str:
    """`2026-12-01T10:00:00Z`."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
