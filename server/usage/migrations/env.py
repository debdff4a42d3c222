"""For the `alembic` command line only (the gateway migrates through
server/usage/migrate.py): the database is NPUGW_USAGE_DB or the
`sqlalchemy.url` of alembic.ini, as a synchronous URL."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine

from server.usage.migrate import VERSION_TABLE
from server.usage.schema import metadata

url = os.environ.get("NPUGW_USAGE_DB") or context.config.get_main_option("sqlalchemy.url")
if not url:
    raise SystemExit("set NPUGW_USAGE_DB (sqlite:///PATH or postgresql://...) or sqlalchemy.url")
engine = create_engine(url.replace("+aiosqlite", "").replace("+asyncpg", ""))
with engine.begin() as conn:
    context.configure(connection=conn, target_metadata=metadata, version_table=VERSION_TABLE)
    with context.begin_transaction():
        context.run_migrations()
