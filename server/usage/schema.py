"""The ledger's tables (SQLAlchemy Core). Their shape in a database is made
by the migrations (server/usage/migrations), applied at start; these
definitions are what the code reads and writes.

- `usage_records`: one row per finished API request (`id` is the ledger's
  own, so a spooled record replayed twice is stored once). `ts` is the
  request's start in seconds since 1970 (UTC), `month` its YYYYMM.
- `usage_daily`: per key and UTC day, the requests and tokens that count
  against budgets, kept in the same transaction as the rows (budgets read
  31 rows per key instead of a month of records).
- `usage_budgets`: budgets set at run time (`PUT /admin/budgets/{key}`),
  which win over the keys file's; `value` NULL means no limit.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Index, Integer, MetaData, String, Table

metadata = MetaData()

records = Table(
    "usage_records",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("ts", Float, nullable=False),
    Column("month", Integer, nullable=False),
    Column("request_id", String(200), nullable=True),
    Column("key", String(256), nullable=False),  # the key's name ("" on an open server), never the key
    Column("method", String(16), nullable=True),
    Column("endpoint", String(256), nullable=False),
    Column("model", String(256), nullable=True),  # as asked
    Column("target", String(256), nullable=True),  # what served it
    Column("upstream", String(512), nullable=True),  # the node's URL, for a passed-through request
    Column("status", Integer, nullable=False),
    Column("finish_reason", String(64), nullable=True),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("queue_wait", Float, nullable=True),
    Column("ttft", Float, nullable=True),
    Column("duration", Float, nullable=False),
    Index("ix_usage_records_ts", "ts"),
    Index("ix_usage_records_key_ts", "key", "ts"),
)

daily = Table(
    "usage_daily",
    metadata,
    Column("key", String(256), primary_key=True),
    Column("day", Integer, primary_key=True),  # days since 1970-01-01 (UTC)
    Column("requests", BigInteger, nullable=False),
    Column("tokens", BigInteger, nullable=False),
)

budgets = Table(
    "usage_budgets",
    metadata,
    Column("key", String(256), primary_key=True),
    Column("name", String(32), primary_key=True),  # tokens_per_day, ..., expires_at
    Column("value", BigInteger, nullable=True),
    Column("updated_at", Float, nullable=False),
)
