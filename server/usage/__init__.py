"""The usage ledger and budgets (issue 18): one record per finished API
request in SQLite (default, DATA_DIR/usage.db) or PostgreSQL, written off
the request path in batches (server/usage/ledger.py), spooled to local
files while the database is down (spool.py); budgets per key enforced at
admission from it (budgets.py); reports (query.py, routes.py, cli.py);
versioned migrations applied at start (migrate.py, migrations/).

    usage = setup_usage(app, settings, registry)   # in create_app
    await start_usage(app)                         # lifespan start
    await stop_usage(app)                          # lifespan end
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from server.settings import Settings
from server.store import database_url
from server.usage.budgets import BudgetBook
from server.usage.ledger import Ledger
from server.usage.state import LedgerCollector, Usage

START_WAIT = 10.0  # seconds the start waits for the database (migrations, budgets) before going on


def ledger_url(settings: Settings) -> str | None:
    """`--usage-db` as an async URL (store.database_url), None for none."""
    return database_url(settings.usage_db, settings.data_dir, "usage.db")


def setup_usage(app: Any, settings: Settings, registry: CollectorRegistry) -> Usage:
    """The ledger and budgets of an app: its record sink, routes and metrics."""
    from server.usage.routes import router

    keystore = app.state.keys
    budgets = BudgetBook(keystore.entries)
    spool = settings.usage_spool_dir or settings.data_dir.expanduser() / "usage-spool"
    ledger = Ledger(
        ledger_url(settings), Path(spool).expanduser(), budgets,
        batch_size=settings.usage_batch_size, buffer_size=settings.usage_buffer_size,
        flush_interval=settings.usage_flush_interval, write_timeout=settings.usage_write_timeout,
    )
    usage = Usage(ledger, budgets, keystore)
    app.state.usage = usage
    app.state.budgets = budgets
    app.state.record_sinks.append(ledger.sink)
    app.include_router(router)
    registry.register(LedgerCollector(ledger))
    return usage


async def start_usage(app: Any) -> None:
    usage: Usage = app.state.usage
    await usage.ledger.start(START_WAIT)


async def stop_usage(app: Any) -> None:
    usage: Usage = app.state.usage
    await usage.ledger.close()
