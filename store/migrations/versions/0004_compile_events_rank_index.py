"""compile_events: an index on (run_id, rank, name) for per-rank reads of one record kind.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_compile_events_run_rank_name", "compile_events", ["run_id", "rank", "name"], unique=False)
    op.execute("UPDATE store_meta SET value = '4' WHERE key = 'schema_version'")


def downgrade() -> None:
    op.drop_index("ix_compile_events_run_rank_name", table_name="compile_events")
    op.execute("UPDATE store_meta SET value = '3' WHERE key = 'schema_version'")
