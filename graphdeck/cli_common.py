"""What the ``graphdeck`` commands share: the default store, ``--store`` values, error exits and
run lookup. graphdeck/cli.py re-exports these names (``from graphdeck.cli import _fail`` keeps
working); the command modules (graphdeck/cli_*.py) import them from here."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from graphdeck.errors import GraphdeckError

DEFAULT_STORE = "graphdeck.db"

# NOTE: [Quick exit]
# A read command (check-ranks, check-grads, check-compile, summary) has printed its report and
# holds nothing to write back: what is left of its process is interpreter teardown — clearing
# the modules of SQLAlchemy, the ORM schema and the analysis, and a last garbage collection —
# ~7% of check-ranks' instructions on a 2-rank store (callgrind, bench/RESULTS.md "Read commands'
# start-up"). Run as the ``graphdeck`` program (no ``args`` given to ``main``: never in-process
# callers such as tests and click's CliRunner), such a command flushes its output and ends with
# ``os._exit``. Not when torch was loaded (check-grads --model: its atexit handlers run) nor when a
# PostgreSQL driver was (the server would log a dropped connection).
QUICK_EXIT = frozenset({"check-ranks", "check-grads", "check-compile", "summary"})


def _quick_exit(code) -> None:
    """End the process as ``sys.exit(code)`` would (None -> 0, an int, else printed and 1), without
    interpreter teardown (NOTE: [Quick exit]). Returns (the caller then raises as usual) when the
    command is not one of :data:`QUICK_EXIT`, torch or a PostgreSQL driver is loaded, or stdout
    cannot be flushed (a closed pipe)."""
    import os

    if len(sys.argv) < 2 or sys.argv[1] not in QUICK_EXIT or {"torch", "psycopg", "psycopg2"} & sys.modules.keys():
        return
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    try:
        if "logging" in sys.modules:
            sys.modules["logging"].shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(status)


def _store_arg(store: str) -> str:
    """A ``--store`` value: a SQLAlchemy URL (``postgresql+psycopg://...``) as given, a path made absolute."""
    return store if "://" in store else str(Path(store).resolve())


def _fail(exc: GraphdeckError) -> None:
    click.echo(f"error: {exc.message}", err=True)
    sys.exit(exc.exit_code)


def _find_run(session, run_name: str, store: str):
    """The run named ``run_name`` (or with that id); NotFoundError otherwise."""
    from sqlalchemy import select

    from graphdeck.errors import NotFoundError
    from graphdeck.store.schema import Run

    run = session.scalar(select(Run).where(Run.name == run_name))
    if run is None and run_name.isdigit():
        run = session.get(Run, int(run_name))
    if run is None:
        raise NotFoundError(f"run {run_name!r} not found in {store}")
    return run


def _is_kineto(path: str) -> bool:
    """A Kineto / Chrome trace by its first bytes (``traceEvents`` or ``schemaVersion`` near the start)."""
    from graphdeck.store.fr_import import file_head

    head = file_head(path)
    return head.lstrip()[:1] == b"{" and (b'"traceEvents"' in head or b'"schemaVersion"' in head)


def _mib(n: int | float | None) -> str:
    """Bytes in the largest binary unit that keeps the figure ≥ 1 (``512 B``, ``10.0 KiB``, ``3.25 MiB``),
    as the dashboard prints them (common.js fmtBytes)."""
    if n is None:
        return "—"
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
