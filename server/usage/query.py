"""Reading the ledger: `GET /admin/usage`, `GET /v1/usage` and
`npu-gateway usage` run the same query.

Filters: `key`, `model` (as asked), `from` and `to` (ISO 8601 dates or
dates and times, UTC unless they say otherwise; `from` included, `to` not;
default: the 30 days up to now), `group_by` one of hour, day, month, key,
model (default day). Each group: requests, prompt, completion and cached
tokens, and errors (a refusal or failure: status 400 and up but 499, the
client leaving; or a stream that failed after its status line). A time
group is named by the start of its bucket (UTC, ISO 8601).
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, and_, case, cast, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from engine_adapter.errors import InvalidRequest
from server.auth import parse_when
from server.usage import schema
from server.usage.periods import DAY, iso

GROUPS = ("hour", "day", "month", "key", "model")
FORMATS = ("json", "csv")
COLUMNS = ("group", "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "errors")
DEFAULT_SPAN = 30 * DAY


@dataclass(frozen=True, slots=True)
class UsageQuery:
    start: float
    end: float
    group_by: str = "day"
    key: str | None = None
    model: str | None = None
    format: str = "json"


def parse_query(params: Mapping[str, str], now: float | None = None) -> UsageQuery:
    """The query string -> a query; raises InvalidRequest (400) naming the
    parameter."""
    now = time.time() if now is None else now
    group_by = params.get("group_by") or "day"
    if group_by not in GROUPS:
        raise InvalidRequest(f"group_by must be one of {', '.join(GROUPS)}, not {group_by!r}", param="group_by")
    fmt = params.get("format") or "json"
    if fmt not in FORMATS:
        raise InvalidRequest(f"format must be json or csv, not {fmt!r}", param="format")
    end = _time(params, "to", now)
    start = _time(params, "from", end - DEFAULT_SPAN)
    if start > end:
        raise InvalidRequest(f"`from` ({iso(start)}) is after `to` ({iso(end)})", param="from")
    key = params.get("key")
    model = params.get("model")
    for name, v in (("key", key), ("model", model)):
        if v is not None and not v.strip():
            raise InvalidRequest(f"`{name}` is empty", param=name)
    return UsageQuery(start, end, group_by, key, model, fmt)


def _time(params: Mapping[str, str], name: str, default: float) -> float:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse_when(raw).timestamp()
    except ValueError:
        raise InvalidRequest(
            f"`{name}` must be an ISO 8601 date or date and time (2026-12-01 or 2026-12-01T10:00:00Z), not {raw!r}",
            param=name,
        ) from None


def _bucket(conn: AsyncConnection, seconds: int) -> Any:
    ts = schema.records.c.ts
    if conn.dialect.name == "postgresql":
        return cast(func.floor(ts / seconds), Integer)
    return cast(ts / seconds, Integer)  # SQLite's CAST truncates (and ts is never negative)


async def key_seen(conn: AsyncConnection, key: str) -> bool:
    t = schema.records
    return (await conn.execute(select(t.c.id).where(t.c.key == key).limit(1))).first() is not None


async def run_query(conn: AsyncConnection, q: UsageQuery) -> list[dict[str, Any]]:
    t = schema.records
    if q.group_by == "hour":
        group: Any = _bucket(conn, 3600)
    elif q.group_by == "day":
        group = _bucket(conn, DAY)
    elif q.group_by == "month":
        group = t.c.month
    else:
        group = t.c.key if q.group_by == "key" else t.c.model
    failed = or_(and_(t.c.status >= 400, t.c.status != 499), t.c.finish_reason == "error")
    stmt = (
        select(
            group.label("g"), func.count().label("requests"), func.sum(t.c.prompt_tokens),
            func.sum(t.c.completion_tokens), func.sum(t.c.cached_tokens), func.sum(case((failed, 1), else_=0)),
        )
        .where(t.c.ts >= q.start, t.c.ts < q.end)
        .group_by(group)
        .order_by(group)
    )
    if q.key is not None:
        stmt = stmt.where(t.c.key == q.key)
    if q.model is not None:
        stmt = stmt.where(t.c.model == q.model)
    out = []
    for g, n, p, c, cached, errors in (await conn.execute(stmt)).all():
        out.append({
            "group": _group_name(q.group_by, g), "requests": int(n), "prompt_tokens": int(p or 0),
            "completion_tokens": int(c or 0), "cached_tokens": int(cached or 0), "errors": int(errors or 0),
        })
    return out


def _group_name(group_by: str, g: Any) -> str | None:
    if group_by == "hour":
        return iso(int(g) * 3600)
    if group_by == "day":
        return iso(int(g) * DAY)
    if group_by == "month":
        return f"{int(g) // 100:04d}-{int(g) % 100:02d}-01T00:00:00Z"
    return None if g is None else str(g)


def as_json(q: UsageQuery, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "group_by": q.group_by, "from": iso(q.start), "to": iso(q.end), "data": rows}


def as_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def as_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table (the command line's default)."""
    cells = [list(COLUMNS)] + [["-" if r[c] is None else str(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = []
    for n, row in enumerate(cells):
        pairs = enumerate(zip(row, widths, strict=True))
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in pairs))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"
