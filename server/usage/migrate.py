"""Apply the ledger's migrations (server/usage/migrations) up to the newest,
at start, with Alembic's own machinery but without an env.py round trip:
one transaction on the caller's connection. On PostgreSQL an advisory lock
makes replicas that start together migrate one after the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "usage_alembic_version"
_LOCK_ID = 0x6E707567_7573_6167 & 0x7FFFFFFFFFFFFFFF  # "npugusag": one advisory lock for the ledger


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def head() -> str:
    rev = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert rev is not None
    return rev


def current(conn: Connection) -> str | None:
    ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return ctx.get_current_revision()


def upgrade(conn: Connection) -> None:
    """Migrate the database of `conn` (in a transaction) to the newest revision."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_ID})
    cfg = alembic_config()
    script = ScriptDirectory.from_config(cfg)

    def steps(rev: Any, _context: Any) -> Any:
        return script._upgrade_revs("head", rev)

    with EnvironmentContext(cfg, script, fn=steps, destination_rev="head") as env:
        env.configure(connection=conn, version_table=VERSION_TABLE)
        with env.begin_transaction():
            env.run_migrations()
