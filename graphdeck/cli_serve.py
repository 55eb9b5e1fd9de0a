"""``graphdeck serve`` (the dashboard and API over a store) and ``graphdeck demo`` (a small
2-rank job captured into a store, then served). Registered on the ``graphdeck`` group by
graphdeck/cli.py (:data:`COMMANDS`); helpers only from graphdeck/cli_common.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from graphdeck.cli_common import DEFAULT_STORE, _fail, _store_arg, port_free
from graphdeck.errors import GraphdeckError


@click.command()
@click.option("--store", default=DEFAULT_STORE, show_default=True,
              help="SQLite file (replaced) or PostgreSQL URL to write and serve (refused when the URL's "
                   "store already holds a run named --run-name: pick another name).")
@click.option("--run-name", default="demo", show_default=True, help="Name of the run in the store.")
@click.option("--nproc", default=2, show_default=True, help="Ranks (processes) to launch with torchrun.")
@click.option("--backend", default="inductor", show_default=True, help="Inner torch.compile backend.")
@click.option("--steps", default=4, show_default=True, help="Training steps per rank.")
@click.option("--serve/--no-serve", default=True, show_default=True, help="Serve the dashboard afterwards.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Dashboard host.")
@click.option("--port", default=8765, show_default=True, help="Dashboard port.")
def demo(store: str, run_name: str, nproc: int, backend: str, steps: int, serve: bool, host: str, port: int) -> None:
    """Train a small GPT-2 on NPROC gloo ranks under DDP + torch.compile with capture, then serve it."""
    t0 = time.perf_counter()
    store_path = _store_arg(store)
    if serve and not port_free(host, port):  # found out now, not after minutes of training
        taken, port = port, port_free(host, 0)
        click.echo(f"[graphdeck] port {taken} on {host} is taken: the dashboard will use port {port}")
    if "://" not in store_path:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{store_path}{suffix}").unlink(missing_ok=True)
    else:  # a database is never dropped: a second demo into the same run would mix two jobs' ranks
        _refuse_existing_run(store_path, run_name)
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    # Kineto prints "USDT: … profiler_start/stop" per rank and step on CPU; its levels end at 5 (USDT),
    # so 6 quiets it for this demo only (a user's own KINETO_LOG_LEVEL wins; the trace is checked on ingest).
    env.setdefault("KINETO_LOG_LEVEL", "6")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "graphdeck.demo", "--store", str(store_path), "--run-name", run_name,
           "--backend", backend, "--steps", str(steps)]
    click.echo(f"[graphdeck] launching {nproc} ranks: {' '.join(cmd[2:])}")
    import subprocess  # not at import: the other commands do not load it (issue 41 goal 4)

    code = subprocess.call(cmd, env=env)
    if code != 0:
        click.echo(f"error: the training job exited with {code}", err=True)
        sys.exit(1)
    from graphdeck.store.db import display_url

    click.echo(f"[graphdeck] job finished in {time.perf_counter() - t0:.1f}s; store {display_url(store_path)}")
    _print_summary(store_path, run_name)
    if serve:
        from graphdeck.server.app import serve as serve_app

        try:
            serve_app(store_path, host=host, port=port, announce=lambda: click.echo(
                f"[graphdeck] dashboard: http://{host}:{port}/#/runs/{run_name}  "
                f"(ready {time.perf_counter() - t0:.1f}s after start; Ctrl-C stops)"))
        except (OSError, SystemExit) as exc:  # the port was taken meanwhile: what was captured is kept
            click.echo(f"error: could not serve on {host}:{port} ({exc}); the run is stored — serve it with:\n"
                       f"  graphdeck serve {store_path} --port <free port>", err=True)
            sys.exit(1)


def _refuse_existing_run(store_url: str, run_name: str) -> None:
    """Exit 2 when the URL store already holds run ``run_name`` (``graphdeck demo`` replaces a
    SQLite file but never drops data from a database)."""
    from sqlalchemy import select

    from graphdeck.errors import UsageError
    from graphdeck.store.db import display_url, open_engine
    from graphdeck.store.schema import Run

    try:
        engine = open_engine(store_url)
        with engine.connect() as conn:
            found = conn.execute(select(Run.id).where(Run.name == run_name)).first()
        engine.dispose()
    except GraphdeckError as exc:
        _fail(exc)
    if found is not None:
        _fail(UsageError(f"{display_url(store_url)} already holds a run named {run_name!r}; graphdeck demo does "
                         "not replace runs in a database: pass another --run-name"))


def _print_summary(store_path: Path, run_name: str) -> None:
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Graph, Run, Trace

    engine = open_engine(store_path, read_only=True)
    with Session(engine) as s:
        run = s.scalar(select(Run).where(Run.name == run_name))
        if run is None:
            return
        rows = s.execute(select(Graph.rank, Graph.kind, func.count(), func.sum(Graph.num_nodes))
                         .where(Graph.run_id == run.id).group_by(Graph.rank, Graph.kind)
                         .order_by(Graph.rank, Graph.kind)).all()
        for r in rows:
            click.echo(f"  rank {r[0]}: {r[2]:3d} {r[1]:<14s} graphs, {r[3]:6d} nodes")
        traces = s.execute(select(Trace.rank, Trace.num_events).where(Trace.run_id == run.id)).all()
        for t in traces:
            click.echo(f"  rank {t[0]}: trace with {t[1]} events")


@click.command()
@click.argument("store", default=DEFAULT_STORE, envvar="GRAPHDECK_STORE")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--port", default=8765, show_default=True, help="Port to bind.")
@click.option("--data-dir", default=None,
              help="Upload chunks folder [$GRAPHDECK_DATA_DIR; default <store>.uploads beside a SQLite file, "
                   "a per-store folder in the temp dir for a URL].")
@click.option("--max-upload-bytes", type=click.IntRange(min=1), default=None,
              help="Largest upload or request body, bytes [$GRAPHDECK_MAX_UPLOAD_BYTES; default 2 GiB].")
@click.option("--max-decompressed-bytes", type=click.IntRange(min=1), default=None,
              help="Largest size a gzip upload may inflate to [$GRAPHDECK_MAX_DECOMPRESSED_BYTES; default 16 GiB].")
@click.option("--max-decompress-ratio", type=click.FloatRange(min=1), default=None,
              help="Largest inflated/compressed ratio past 64 MiB [$GRAPHDECK_MAX_DECOMPRESS_RATIO; default 200].")
@click.option("--upload-ttl-s", type=click.FloatRange(min=1), default=None,
              help="Unfinished/finished uploads untouched this long are swept from the data dir "
                   "[$GRAPHDECK_UPLOAD_TTL_S; default 604800 = 7 days].")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="A Host name a request over loopback may carry besides localhost, 127.0.0.1, [::1] and this "
                   "machine's name (e.g. a local proxy's), repeatable [$GRAPHDECK_ALLOWED_HOSTS, comma-separated].")
@click.option("--link-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Peak bandwidth of the link between ranks, GB/s: each collective's bus bandwidth is shown "
                   "as a share of it [$GRAPHDECK_LINK_GBPS; default none].")
@click.option("--create", is_flag=True, help="Create an empty SQLite store when STORE does not exist "
                                             "(without it, a missing file is an error: a mistyped name).")
def serve(store: str, host: str, port: int, data_dir: str | None, max_upload_bytes: int | None,
          max_decompressed_bytes: int | None, max_decompress_ratio: float | None, upload_ttl_s: float | None,
          allowed_hosts: tuple[str, ...], link_gbps: float | None, create: bool) -> None:
    """Serve the dashboard and API over STORE (a SQLite file or a PostgreSQL URL; $GRAPHDECK_STORE).

    \b
    Environment (an option given on the command line wins):
      GRAPHDECK_STORE                   the store, when STORE is not given
      GRAPHDECK_WRITE_TOKENS            comma-separated tokens that may upload (none: loopback only)
      GRAPHDECK_READ_TOKENS             comma-separated tokens that may read (none: reads are open)
      GRAPHDECK_ALLOWED_HOSTS           --allowed-host (comma-separated)
      GRAPHDECK_DATA_DIR                --data-dir
      GRAPHDECK_MAX_UPLOAD_BYTES        --max-upload-bytes
      GRAPHDECK_MAX_DECOMPRESSED_BYTES  --max-decompressed-bytes
      GRAPHDECK_MAX_DECOMPRESS_RATIO    --max-decompress-ratio
      GRAPHDECK_UPLOAD_TTL_S            --upload-ttl-s
      GRAPHDECK_LINK_GBPS               --link-gbps
      GRAPHDECK_STORE_MAX_BYTES         SQLite only: a size quota on the store (507 when reached)
    """
    from graphdeck.server.app import serve as serve_app

    store_path = _store_arg(store)
    if "://" not in store_path and not Path(store_path).exists() and not create:
        from graphdeck.errors import UsageError

        _fail(UsageError(f"no store at {store_path}: check the path (or pass --create to serve a new, empty store)"))
    given = {"data_dir": data_dir, "max_upload_bytes": max_upload_bytes,
             "max_decompressed_bytes": max_decompressed_bytes, "max_decompress_ratio": max_decompress_ratio,
             "upload_ttl_s": upload_ttl_s, "allowed_hosts": allowed_hosts or None, "link_gbps": link_gbps}
    try:
        serve_app(store_path, host=host, port=port, **{k: v for k, v in given.items() if v is not None},
                  announce=lambda: click.echo(f"[graphdeck] dashboard: http://{host}:{port}/"))
    except GraphdeckError as exc:  # e.g. a store written by a newer graphdeck: refuse to start
        _fail(exc)


COMMANDS = (demo, serve)
