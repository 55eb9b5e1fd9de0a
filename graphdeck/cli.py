"""The ``graphdeck`` command: thin commands over library functions.

Exit codes: 0 ok, 1 a check failed (or an internal error), 2 usage or bad input.

This module only assembles the click group: the commands live in modules by concern
(``cli_checks``: check-grads/check-ranks, ``cli_compile``: check-compile, ``cli_db``: db/stack,
``cli_diff``: diff-runs, ``cli_export``: export-trace, ``cli_ingest``:
ingest-trace/import/upload/delete-run, ``cli_memory``: memory/memory-snapshot, ``cli_parity``,
``cli_replay``, ``cli_run``: run, ``cli_serve``: serve/demo, ``cli_summary``), each listing its commands in
``COMMANDS``; :data:`COMMAND_MODULES` below registers them. A command module imports shared
helpers from ``cli_common`` only, never this module nor another command module (pyproject's
import-linter contract ``cli-commands``). The helpers are re-exported here for old callers.
"""

from __future__ import annotations

import sys

import click

from graphdeck import (
    cli_checks,
    cli_compile,
    cli_db,
    cli_diff,
    cli_export,
    cli_ingest,
    cli_memory,
    cli_parity,
    cli_replay,
    cli_run,
    cli_serve,
    cli_summary,
    cli_watch,
)
from graphdeck.cli_common import (  # noqa: F401 (re-exported for callers of graphdeck.cli)
    DEFAULT_STORE,
    _fail,
    _find_run,
    _is_kineto,
    _mib,
    _store_arg,
    port_free,
)

#: The modules whose ``COMMANDS`` make up the ``graphdeck`` group (a new command module: one
#: import above, one line here).
COMMAND_MODULES = (
    cli_checks,
    cli_compile,
    cli_db,
    cli_diff,
    cli_export,
    cli_ingest,
    cli_memory,
    cli_parity,
    cli_replay,
    cli_run,
    cli_serve,
    cli_summary,
    cli_watch,
)


class _Group(click.Group):
    """The ``graphdeck`` group: run as the program (no ``args``), a read command ends without
    interpreter teardown (NOTE: [Quick exit] in graphdeck/cli_common.py)."""

    def main(self, args=None, *rest, **kwargs):
        if args is not None or not kwargs.get("standalone_mode", True) or rest:
            return super().main(args, *rest, **kwargs)
        from graphdeck.cli_common import PRELOAD_STORE

        if sys.argv[1:2] and sys.argv[1] in PRELOAD_STORE and "--help" not in sys.argv:
            _load_store_modules()
        try:
            return super().main(args, **kwargs)
        except SystemExit as exc:
            from graphdeck.cli_common import _quick_exit

            _quick_exit(exc.code)
            raise


def _load_store_modules() -> None:
    """SQLAlchemy's ORM and the store schema, which every read command (and ingest-trace) loads first, imported with
    the garbage collector off, then frozen (``gc.freeze``: later collections skip them): their
    objects (classes, functions, the mapped tables) live as long as the process, so collecting
    during their import is work without a result (check-ranks on a 2-rank store: 1.75 -> 1.64 G
    instructions, callgrind; bench/RESULTS.md "Read commands' start-up (issue 26 item 4, third pass)")."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        import sqlalchemy.orm  # noqa: F401

        import graphdeck.store.schema  # noqa: F401
    finally:
        if enabled:
            gc.enable()
        gc.freeze()


@click.group(cls=_Group)
@click.version_option(package_name="graphdeck")
def main() -> None:
    """graphdeck: a debugger for compiled graphs in distributed PyTorch training."""


for _module in COMMAND_MODULES:
    for _command in _module.COMMANDS:
        main.add_command(_command)

if __name__ == "__main__":
    main()
