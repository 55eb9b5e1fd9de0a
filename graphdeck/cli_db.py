"""``graphdeck db current|upgrade`` (the store's schema, Alembic) and ``graphdeck stack``
(docker-compose.yml's services without Docker). Registered on the ``graphdeck`` group by
graphdeck/cli.py (:data:`COMMANDS`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from graphdeck.cli_common import DEFAULT_STORE, _fail, _store_arg
from graphdeck.errors import GraphdeckError


@click.group("db")
def db_group() -> None:
    """The store's schema: which version it is at, and migrating it (Alembic)."""


@db_group.command("current")
@click.argument("store", default=DEFAULT_STORE, envvar="GRAPHDECK_STORE")
def db_current(store: str) -> None:
    """Print STORE's schema revision and the one this graphdeck writes."""
    from sqlalchemy import create_engine

    from graphdeck.errors import NotFoundError
    from graphdeck.store import migrate
    from graphdeck.store.db import display_url, store_url

    if "://" not in store and not Path(store).exists():
        _fail(NotFoundError(f"store {store} does not exist"))
    engine = create_engine(store_url(_store_arg(store)))
    try:
        with engine.connect() as conn:
            info = migrate.describe(conn)
    finally:
        engine.dispose()
    rev = info["revision"] or "none (empty, or made before Alembic)"
    version = info["schema_version"] if info["schema_version"] is not None else "none"
    click.echo(f"{display_url(store)}: revision {rev}, store_meta schema_version {version}; "
               f"this graphdeck: revision {info['head']}")
    click.echo(f"{info['state']}: {info['message']}")


@db_group.command("upgrade")
@click.argument("store", default=DEFAULT_STORE, envvar="GRAPHDECK_STORE")
@click.option("--revision", default="head", show_default=True, help="Alembic revision to migrate to.")
def db_upgrade(store: str, revision: str) -> None:
    """Migrate STORE (SQLite file or PostgreSQL URL) to REVISION keeping its data; an empty one is created."""
    from graphdeck.store import migrate
    from graphdeck.store.db import display_url, open_engine

    try:
        engine = open_engine(_store_arg(store)) if revision == "head" else None  # an empty store is created
        if engine is None:
            from sqlalchemy import create_engine

            from graphdeck.store.db import store_url

            engine = create_engine(store_url(_store_arg(store)))
            migrate.upgrade(engine, revision)
        with engine.connect() as conn:
            rev = migrate.current_revision(conn)
        engine.dispose()
    except GraphdeckError as exc:
        _fail(exc)
    click.echo(f"{display_url(store)}: at revision {rev}")


@click.command("stack")
@click.option("--dir", "data_dir", default="graphdeck-stack", show_default=True,
              help="Folder kept across runs: PostgreSQL's cluster (pg/) and upload chunks (uploads/); a later "
                   "stack on the same folder serves the same runs. As root, when the postgres user cannot "
                   "reach it, the cluster runs in a temp folder and is copied back here at stop.")
@click.option("--store", default=None, help="Serve this store (SQLite path or URL) instead of starting PostgreSQL.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Server interface.")
@click.option("--port", default=8765, show_default=True, help="Server port.")
@click.option("--pg-port", type=int, default=None, help="Local PostgreSQL port (default: a free one).")
@click.option("--token", default=None, help="Write token (default: $GRAPHDECK_TOKEN, else a random one, printed).")
@click.option("--demo/--no-demo", default=True, show_default=True, help="Run the 2-rank demo job uploading over HTTP.")
@click.option("--demo-steps", default=2, show_default=True, help="Training steps of the demo job.")
@click.option("--exit-after-demo", is_flag=True, help="Stop every service once the demo job is done.")
def stack_cmd(data_dir: str, store: str | None, host: str, port: int, pg_port: int | None, token: str | None,
              demo: bool, demo_steps: int, exit_after_demo: bool) -> None:
    """Run docker-compose.yml's services without Docker: PostgreSQL, the server, the 2-rank demo job."""
    from graphdeck.stack import StackOptions, run_stack

    opts = StackOptions(data_dir=Path(data_dir).resolve(), store=_store_arg(store) if store else None, host=host,
                        port=port, pg_port=pg_port, token=token, demo=demo, demo_steps=demo_steps,
                        exit_after_demo=exit_after_demo, log=lambda m: click.echo(m, err=True))
    try:
        code = run_stack(opts)
    except GraphdeckError as exc:
        _fail(exc)
    sys.exit(code)


COMMANDS = (db_group, stack_cmd)
