"""The usage ledger: records, daily rollups for budgets, run-time budgets.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_records",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("month", sa.Integer, nullable=False),
        sa.Column("request_id", sa.String(200), nullable=True),
        sa.Column("key", sa.String(256), nullable=False),
        sa.Column("method", sa.String(16), nullable=True),
        sa.Column("endpoint", sa.String(256), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("target", sa.String(256), nullable=True),
        sa.Column("upstream", sa.String(512), nullable=True),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.String(64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("queue_wait", sa.Float, nullable=True),
        sa.Column("ttft", sa.Float, nullable=True),
        sa.Column("duration", sa.Float, nullable=False),
    )
    op.create_index("ix_usage_records_ts", "usage_records", ["ts"])
    op.create_index("ix_usage_records_key_ts", "usage_records", ["key", "ts"])
    op.create_table(
        "usage_daily",
        sa.Column("key", sa.String(256), primary_key=True),
        sa.Column("day", sa.Integer, primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "usage_budgets",
        sa.Column("key", sa.String(256), primary_key=True),
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("value", sa.BigInteger, nullable=True),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("usage_budgets")
    op.drop_table("usage_daily")
    op.drop_index("ix_usage_records_key_ts", "usage_records")
    op.drop_index("ix_usage_records_ts", "usage_records")
    op.drop_table("usage_records")
