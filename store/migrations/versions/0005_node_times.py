"""node_time_sets / node_times: per-trace node times written at trace ingest (diff-runs, overlays).

Existing traces get no rows: readers compute their node times from the events, as before
(NOTE: [Node-time table] in graphdeck/store/node_times.py).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_time_sets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=64), nullable=True),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("mapped_calls", sa.Integer(), nullable=False),
        sa.Column("unmapped_calls", sa.Integer(), nullable=False),
        sa.Column("missing", sa.Text(), nullable=True),
        sa.Column("graphs_count", sa.Integer(), nullable=False),
        sa.Column("last_graph_id", sa.Integer(), nullable=True),
        sa.Column("kernel_nodes_count", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["last_graph_id"], ["graphs.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["trace_id"], ["traces.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("trace_id", "method"),
    )
    op.create_index(op.f("ix_node_time_sets_run_id"), "node_time_sets", ["run_id"], unique=False)
    op.create_table(
        "node_times",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("set_id", sa.Integer(), nullable=False),
        sa.Column("graph_id", sa.Integer(), nullable=False),
        sa.Column("node_name", sa.String(length=300), nullable=False),
        sa.Column("total_ns", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("steps_ns_json", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["graph_id"], ["graphs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["set_id"], ["node_time_sets.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_node_times_set", "node_times", ["set_id"], unique=False)
    op.create_index(op.f("ix_node_times_graph_id"), "node_times", ["graph_id"], unique=False)
    op.execute("UPDATE store_meta SET value = '5' WHERE key = 'schema_version'")


def downgrade() -> None:
    op.drop_index(op.f("ix_node_times_graph_id"), table_name="node_times")
    op.drop_index("ix_node_times_set", table_name="node_times")
    op.drop_table("node_times")
    op.drop_index(op.f("ix_node_time_sets_run_id"), table_name="node_time_sets")
    op.drop_table("node_time_sets")
    op.execute("UPDATE store_meta SET value = '4' WHERE key = 'schema_version'")
