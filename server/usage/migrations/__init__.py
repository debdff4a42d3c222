"""Versioned schema migrations of the usage ledger (Alembic), applied at
start by `server/usage/migrate.py` with their own version table
(`usage_alembic_version`), so a database shared with other tools keeps
theirs. A new migration: `alembic -c server/usage/migrations/alembic.ini
revision -m "what changes"` (or copy the last file in versions/)."""
