"""``graphdeck summary RUN --store S`` (or ``STORE --run RUN``, as the checks): the run overview as one line per check (issue 23 item 2; NOTE:
[Run overview] in graphdeck/analysis/summary.py), the same document as the run page's overview
and ``GET /api/runs/{id}/summary``. Registered on the ``graphdeck`` group by
graphdeck/cli.py (:data:`COMMANDS`)."""

from __future__ import annotations

import json
import sys

import click

from graphdeck.cli_common import _find_run, _store_arg, store_and_run
from graphdeck.errors import GraphdeckError


@click.command("summary")
@store_and_run(run_help="Run name or id, as the checks take it: graphdeck summary STORE --run RUN.")
@click.option("--json", "as_json", is_flag=True, help="The JSON document of GET /api/runs/{id}/summary.")
def summary_cmd(store: str, run_name: str, as_json: bool) -> None:
    """One line per check of a run (name or id): gradient paths (check-grads), rank consistency
    (check-ranks), compile health (check-compile, no gates), trace coverage (per rank, the share
    of the GPU kernel time of compiled graphs / of the ops' own CPU time in compiled regions mapped
    to graph nodes; time outside compiled graphs by design named apart), the parallel layout when one was
    recorded; worst first, then the slowest steps. Two forms, the same report:
    ``graphdeck summary RUN --store STORE`` and, as the checks take it,
    ``graphdeck summary STORE --run RUN``. A check that raises is an ERROR line, never a
    pass. Exit 0 all pass, 1 any FAIL, 3 any INCOMPLETE or ERROR (and none FAIL), 2 bad input
    (no such store or run, no run given, two stores given)."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.summary import run_summary
    from graphdeck.store.db import display_url, open_engine

    store = _store_arg(store)  # both forms: NOTE: [Store and run arguments] in graphdeck/cli_common.py
    try:
        engine = open_engine(store, read_only=True)
        with Session(engine) as s:
            report = run_summary(s, _find_run(s, run_name, display_url(store)))
    except GraphdeckError as exc:  # the store or run cannot be read: bad input, not a failed check
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report.to_dict(), indent=1, default=str) if as_json else report.to_text(display_url(store)))
    sys.exit(report.exit_code)


COMMANDS = (summary_cmd,)
