"""Alembic environment of the graphdeck store.

``target_metadata`` is :data:`graphdeck.store.schema.Base.metadata`, the one schema. The caller
(:mod:`graphdeck.store.migrate`) hands over an open connection in ``config.attributes["connection"]``
and runs everything inside its transaction (on SQLite under the write lock, on PostgreSQL under an
advisory lock), so several ranks opening one store at once migrate it exactly once. Without a
connection (the ``alembic`` command line), ``sqlalchemy.url`` is used. SQLite gets
``render_as_batch`` (its ALTER TABLE cannot change or drop columns in place).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from graphdeck.store.schema import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
