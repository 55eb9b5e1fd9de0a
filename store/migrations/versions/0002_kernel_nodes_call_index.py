"""kernel_nodes.call_index: which call site of a kernel a row maps (Inductor's provenance handle).

Folds in the ad-hoc ``ALTER TABLE`` that ``analysis/traces/mapping.py`` ran on stores of version 1:
a store that already has the column keeps it as it is.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    have = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("kernel_nodes")}
    if "call_index" not in have:
        op.add_column("kernel_nodes", sa.Column("call_index", sa.Integer(), nullable=True))
    op.execute("UPDATE store_meta SET value = '2' WHERE key = 'schema_version'")


def downgrade() -> None:
    with op.batch_alter_table("kernel_nodes") as batch_op:
        batch_op.drop_column("call_index")
    op.execute("UPDATE store_meta SET value = '1' WHERE key = 'schema_version'")
