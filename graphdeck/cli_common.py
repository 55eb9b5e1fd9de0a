"""What the ``graphdeck`` commands share: the default store, ``--store`` values, error exits, run
lookup and a free port. The command modules (graphdeck/cli_*.py) import them from here and from no
other command module nor graphdeck/cli.py (pyproject's import-linter contract ``cli-commands``);
graphdeck/cli.py re-exports them (``from graphdeck.cli import _fail`` keeps working)."""

from __future__ import annotations

import functools
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
#: Commands that load SQLAlchemy's ORM and the store schema first, with the garbage collector off
#: (graphdeck/cli.py ``_load_store_modules``): the read commands, and ``ingest-trace`` (its ORM
#: import 0.34 -> 0.29 CPU s, issue 41), which still ends with the interpreter's teardown (its
#: SQLite connections close and checkpoint their WAL).
PRELOAD_STORE = QUICK_EXIT | {"ingest-trace"}


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


# NOTE: [Store and run arguments] Every command that reads a run of a store takes both forms:
# ``CMD STORE --run RUN`` (the checks' form) and ``CMD RUN --store STORE`` (summary's), plus
# ``CMD --store STORE --run RUN`` and ``CMD RUN`` (the default store, or $GRAPHDECK_STORE). The
# one positional is the store when ``--run`` is given, the run when ``--store`` is given (on the
# command line or in $GRAPHDECK_STORE), and alone it is the store when it looks like one (a URL,
# a name ending .db/.sqlite/.sqlite3, or an existing SQLite file), else the run.
_STORE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def looks_like_store(text: str) -> bool:
    """Whether a lone positional is a store rather than a run (NOTE: [Store and run arguments])."""
    if "://" in text or text.lower().endswith(_STORE_SUFFIXES):
        return True
    try:
        with open(text, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def resolve_store_run(ctx: click.Context, target: str | None, store: str | None, run: str | None,
                      *, run_required: bool = True) -> tuple[str, str | None]:
    """``(store, run)`` from the positional ``target`` and the ``--store``/``--run`` options (NOTE:
    [Store and run arguments]); the store is :data:`DEFAULT_STORE` when none is given.

    Raises:
        click.UsageError: (exit 2) two different stores, two different runs, or no run when
            ``run_required``."""
    src = ctx.get_parameter_source("store") if store is not None else None
    on_line = src == click.core.ParameterSource.COMMANDLINE
    if target is not None:
        if run is not None:
            if on_line and store != target:
                raise click.UsageError(f"two stores given ({target} and --store {store}): give one")
            store = target
        elif store is not None or not looks_like_store(target):
            run = target
        else:
            store = target
    if run is None and run_required:
        raise click.UsageError("give the run: STORE --run RUN, or RUN --store STORE")
    return (store if store is not None else DEFAULT_STORE), run


def store_and_run(*, run_required: bool = True, run_help: str = "Run name or id.",
                  store_help: str = "SQLite file or PostgreSQL URL [$GRAPHDECK_STORE; default graphdeck.db].",
                  positional: bool = True):
    """Decorator (put it right under ``@click.command``) giving a command the positional
    ``[STORE | RUN]`` and the options ``--store`` and ``--run``, resolved by
    :func:`resolve_store_run`; the command function receives ``store`` and ``run_name``."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, target=None, store=None, run_name=None, **kw):
            store, run_name = resolve_store_run(click.get_current_context(), target, store, run_name,
                                                run_required=run_required)
            return fn(*args, store=store, run_name=run_name, **kw)

        wrapper.__click_params__ = list(getattr(fn, "__click_params__", []))
        wrapper = click.option("--run", "run_name", default=None, metavar="RUN", help=run_help)(wrapper)
        wrapper = click.option("--store", default=None, metavar="STORE", envvar="GRAPHDECK_STORE",
                               help=store_help)(wrapper)
        if positional:
            wrapper = click.argument("target", metavar="[STORE | RUN]", required=False)(wrapper)
        return wrapper

    return deco


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


def port_free(host: str, port: int) -> int:
    """``port`` (or, for 0, a port the OS picks) when a server can bind ``host:port`` now, else 0."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, port))
            return sock.getsockname()[1]
    except OSError:
        return 0
