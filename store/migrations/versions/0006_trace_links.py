"""trace_links: one trace's kernel → node links, written at trace ingest, read by export-trace.

Existing traces get no row: export-trace maps their events as before (NOTE: [Stored kernel links]
in graphdeck/analysis/traces/export_map.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "trace_links",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("graphs_count", sa.Integer(), nullable=False),
        sa.Column("last_graph_id", sa.Integer(), nullable=True),
        sa.Column("kernel_nodes_count", sa.Integer(), nullable=False),
        sa.Column("events_count", sa.Integer(), nullable=False),
        sa.Column("first_event_id", sa.BigInteger(), nullable=True),
        sa.Column("last_event_id", sa.BigInteger(), nullable=True),
        sa.Column("links_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["last_graph_id"], ["graphs.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["trace_id"], ["traces.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("trace_id", "method"),
    )
    op.create_index(op.f("ix_trace_links_run_id"), "trace_links", ["run_id"], unique=False)
    op.execute("UPDATE store_meta SET value = '6' WHERE key = 'schema_version'")


def downgrade() -> None:
    op.drop_index(op.f("ix_trace_links_run_id"), table_name="trace_links")
    op.drop_table("trace_links")
    op.execute("UPDATE store_meta SET value = '5' WHERE key = 'schema_version'")
