"""`npu-gateway usage`: the ledger's report on the command line, the same
query as `GET /admin/usage`, read from the database directly (the
gateway's own `--usage-db`/`--data-dir`, flags or NPUGW_* environment).

    npu-gateway usage --group-by key --from 2026-12-01
    npu-gateway usage --key alice --group-by day --format csv
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson

from engine_adapter.errors import GatewayError

GROUPS = ("hour", "day", "month", "key", "model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--usage-db", default=argparse.SUPPRESS, help="the ledger's database (as serve's --usage-db)")
    p.add_argument("--data-dir", default=argparse.SUPPRESS, help="as serve's --data-dir (default ledger file)")
    p.add_argument("--config", default=argparse.SUPPRESS, help="the gateway's YAML settings file")
    p.add_argument("--key", help="one key's usage (its name)")
    p.add_argument("--model", help="one model's usage (as asked)")
    p.add_argument("--from", dest="start", help="from this ISO 8601 date or time, UTC (default: 30 days ago)")
    p.add_argument("--to", dest="end", help="up to this ISO 8601 date or time, UTC (default: now)")
    p.add_argument("--group-by", default="day", choices=GROUPS, help="rows by (default: day)")
    p.add_argument("--format", default="table", choices=("table", "csv", "json"), help="output (default: table)")


def run(ns: argparse.Namespace) -> int:
    from server.settings import Settings

    given = {k: getattr(ns, k) for k in ("usage_db", "data_dir", "config") if hasattr(ns, k)}
    try:
        settings = Settings(**given)
    except Exception as e:
        print(f"npu-gateway usage: invalid settings:\n{e}", file=sys.stderr)
        return 2
    params = {"group_by": ns.group_by, "format": "csv" if ns.format == "csv" else "json"}
    for name, value in (("key", ns.key), ("model", ns.model), ("from", ns.start), ("to", ns.end)):
        if value is not None:
            params[name] = value
    try:
        return asyncio.run(_report(settings, params, ns.format))
    except GatewayError as e:
        print(f"npu-gateway usage: {e.message}", file=sys.stderr)
        return 2


async def _report(settings: object, params: dict[str, str], fmt: str) -> int:
    from server.usage import ledger_url
    from server.usage.ledger import LedgerDatabase
    from server.usage.query import as_csv, as_json, as_table, parse_query, run_query

    url = ledger_url(settings)  # type: ignore[arg-type]
    if url is None:
        print("npu-gateway usage: the usage ledger is off (--usage-db none)", file=sys.stderr)
        return 2
    q = parse_query(params)
    db = LedgerDatabase(url, timeout=10.0)  # migrated like the gateway's: a new ledger reads as empty
    try:
        async with db.begin() as conn:
            rows = await run_query(conn, q)
    except Exception as e:
        print(f"npu-gateway usage: cannot read the ledger at {_safe(url)}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        await db.close()
    if fmt == "csv":
        sys.stdout.write(as_csv(rows))
    elif fmt == "json":
        sys.stdout.write(orjson.dumps(as_json(q, rows), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(as_table(rows))
    return 0


def _safe(url: str) -> str:
    """The URL without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        return f"{scheme}://{cred.split(':', 1)[0]}:***@{host}"
    return url
