"""Initial schema (version 1): the store as graphdeck wrote it before Alembic.

``kernel_nodes.call_index`` came later (revision 0002). Stores made before Alembic (``store_meta``
schema_version 1, no ``alembic_version``) are stamped at this revision when first opened for
writing, then upgraded.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('meta_json', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('store_meta',
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('key')
    )
    op.create_table('strings',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('value')
    )
    op.create_table('compile_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('compile_id', sa.String(length=64), nullable=True),
    sa.Column('metadata_json', sa.Text(), nullable=False),
    sa.Column('payload', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_compile_events_run_id'), 'compile_events', ['run_id'])

    op.create_table('graphs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('ordinal', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=300), nullable=False),
    sa.Column('compile_id', sa.String(length=64), nullable=True),
    sa.Column('frame_name', sa.String(length=300), nullable=True),
    sa.Column('parent_id', sa.Integer(), nullable=True),
    sa.Column('partition_index', sa.Integer(), nullable=True),
    sa.Column('num_nodes', sa.Integer(), nullable=False),
    sa.Column('structural_hash', sa.String(length=64), nullable=True),
    sa.Column('compile_time_s', sa.Float(), nullable=True),
    sa.Column('backend', sa.String(length=64), nullable=True),
    sa.Column('break_reason', sa.Text(), nullable=True),
    sa.Column('code', sa.Text(), nullable=True),
    sa.Column('meta_json', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['parent_id'], ['graphs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_graphs_run_rank', 'graphs', ['run_id', 'rank'])

    op.create_table('params',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('fqn', sa.String(length=500), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('storage_key', sa.String(length=64), nullable=False),
    sa.Column('shape_json', sa.Text(), nullable=False),
    sa.Column('dtype', sa.String(length=32), nullable=False),
    sa.Column('numel', sa.BigInteger(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('requires_grad', sa.Boolean(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'rank', 'fqn')
    )
    op.create_index(op.f('ix_params_run_id'), 'params', ['run_id'])

    op.create_table('ranks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('hostname', sa.String(length=200), nullable=True),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('backend', sa.String(length=32), nullable=True),
    sa.Column('torch_version', sa.String(length=64), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('meta_json', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'rank')
    )
    op.create_index(op.f('ix_ranks_run_id'), 'ranks', ['run_id'])

    op.create_table('traces',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=300), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('num_events', sa.Integer(), nullable=False),
    sa.Column('start_ns', sa.BigInteger(), nullable=True),
    sa.Column('end_ns', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('stats_json', sa.Text(), nullable=False),
    sa.Column('meta_json', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_traces_run_id'), 'traces', ['run_id'])

    op.create_table('edges',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('graph_id', sa.Integer(), nullable=False),
    sa.Column('src_idx', sa.Integer(), nullable=False),
    sa.Column('dst_idx', sa.Integer(), nullable=False),
    sa.Column('arg_pos', sa.Integer(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['graph_id'], ['graphs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_edges_graph_id'), 'edges', ['graph_id'])

    op.create_table('graph_io',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('graph_id', sa.Integer(), nullable=False),
    sa.Column('direction', sa.String(length=8), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('node_name', sa.String(length=300), nullable=True),
    sa.Column('param_fqn', sa.String(length=500), nullable=True),
    sa.Column('has_grad', sa.Boolean(), nullable=True),
    sa.Column('desc', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['graph_id'], ['graphs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_graph_io_graph_id'), 'graph_io', ['graph_id'])

    op.create_table('kernel_nodes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('compile_id', sa.String(length=64), nullable=True),
    sa.Column('graph_id', sa.Integer(), nullable=True),
    sa.Column('kernel_name', sa.String(length=500), nullable=False),
    sa.Column('node_name', sa.String(length=300), nullable=False),
    sa.Column('pre_grad_node', sa.String(length=300), nullable=True),
    sa.Column('source', sa.String(length=32), nullable=False),
    sa.ForeignKeyConstraint(['graph_id'], ['graphs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_kernel_nodes_graph_id'), 'kernel_nodes', ['graph_id'])
    op.create_index('ix_kernel_nodes_run_kernel', 'kernel_nodes', ['run_id', 'kernel_name'])

    op.create_table('nodes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('graph_id', sa.Integer(), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=300), nullable=False),
    sa.Column('op', sa.String(length=32), nullable=False),
    sa.Column('target_id', sa.Integer(), nullable=False),
    sa.Column('args_json', sa.Text(), nullable=False),
    sa.Column('shape_json', sa.Text(), nullable=True),
    sa.Column('dtype', sa.String(length=32), nullable=True),
    sa.Column('stride_json', sa.Text(), nullable=True),
    sa.Column('device', sa.String(length=32), nullable=True),
    sa.Column('size_bytes', sa.BigInteger(), nullable=True),
    sa.Column('module_path_id', sa.Integer(), nullable=True),
    sa.Column('module_stack_json', sa.Text(), nullable=True),
    sa.Column('stack_trace_id', sa.Integer(), nullable=True),
    sa.Column('seq_nr', sa.Integer(), nullable=True),
    sa.Column('partitioner_tag', sa.String(length=64), nullable=True),
    sa.Column('desc', sa.Text(), nullable=True),
    sa.Column('param_fqn', sa.String(length=500), nullable=True),
    sa.Column('meta_json', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['graph_id'], ['graphs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['module_path_id'], ['strings.id'], ),
    sa.ForeignKeyConstraint(['stack_trace_id'], ['strings.id'], ),
    sa.ForeignKeyConstraint(['target_id'], ['strings.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('graph_id', 'idx')
    )
    op.create_index(op.f('ix_nodes_graph_id'), 'nodes', ['graph_id'])

    op.create_table('partitions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('parent_graph_id', sa.Integer(), nullable=True),
    sa.Column('graph_id', sa.Integer(), nullable=True),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('params_json', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['graph_id'], ['graphs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['parent_graph_id'], ['graphs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_partitions_run_id'), 'partitions', ['run_id'])

    op.create_table('trace_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('trace_id', sa.Integer(), nullable=False),
    sa.Column('ph', sa.String(length=2), nullable=False),
    sa.Column('name_id', sa.Integer(), nullable=False),
    sa.Column('cat_id', sa.Integer(), nullable=True),
    sa.Column('ts_ns', sa.BigInteger(), nullable=False),
    sa.Column('dur_ns', sa.BigInteger(), nullable=False),
    sa.Column('pid', sa.String(length=64), nullable=False),
    sa.Column('tid', sa.String(length=64), nullable=False),
    sa.Column('correlation', sa.BigInteger(), nullable=True),
    sa.Column('args_json', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['cat_id'], ['strings.id'], ),
    sa.ForeignKeyConstraint(['name_id'], ['strings.id'], ),
    sa.ForeignKeyConstraint(['trace_id'], ['traces.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_trace_events_trace_ts', 'trace_events', ['trace_id', 'ts_ns'])
    op.bulk_insert(sa.table('store_meta', sa.column('key', sa.String), sa.column('value', sa.Text)),
                   [{'key': 'schema_version', 'value': '1'}])


def downgrade() -> None:
    op.drop_table('trace_events')
    op.drop_table('partitions')
    op.drop_table('nodes')
    op.drop_table('kernel_nodes')
    op.drop_table('graph_io')
    op.drop_table('edges')
    op.drop_table('traces')
    op.drop_table('ranks')
    op.drop_table('params')
    op.drop_table('graphs')
    op.drop_table('compile_events')
    op.drop_table('strings')
    op.drop_table('store_meta')
    op.drop_table('runs')
