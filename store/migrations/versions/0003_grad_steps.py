"""grad_steps: run-time gradient evidence per rank and run of identical steps.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "grad_steps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step_first", sa.Integer(), nullable=False),
        sa.Column("step_last", sa.Integer(), nullable=False),
        sa.Column("n_backward", sa.Integer(), nullable=False),
        sa.Column("step_source", sa.String(length=16), nullable=False),
        sa.Column("closed", sa.Boolean(), nullable=False),
        sa.Column("state_json", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_grad_steps_run_rank", "grad_steps", ["run_id", "rank"], unique=False)
    op.execute("UPDATE store_meta SET value = '3' WHERE key = 'schema_version'")


def downgrade() -> None:
    op.drop_index("ix_grad_steps_run_rank", table_name="grad_steps")
    op.drop_table("grad_steps")
    op.execute("UPDATE store_meta SET value = '2' WHERE key = 'schema_version'")
