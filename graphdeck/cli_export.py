"""``graphdeck export-trace``: one Chrome-trace JSON of a run's ranks, clocks aligned, for Perfetto
(issue 26 item 3; NOTE: [Trace export] in graphdeck/analysis/traces/export.py). Registered on the
``graphdeck`` group by graphdeck/cli.py (:data:`COMMANDS`); everything heavy is imported inside
the command."""

from __future__ import annotations

import re
import sys
import time

import click

from graphdeck.cli_common import _fail, _find_run, _store_arg, store_and_run
from graphdeck.errors import GraphdeckError


def default_output(run_name: str) -> str:
    """``<run>.trace.json.gz`` with anything but ``[A-Za-z0-9_.-]`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_name).strip(".") + ".trace.json.gz"


@click.command("export-trace")
@store_and_run()
@click.option("--ranks", default=None, metavar="LIST",
              help="Ranks to export: all (default), or a list of ranks and ranges such as 0,2-5.")
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False),
              help="File to write (gzip when it ends in .gz); default <run>.trace.json.gz here.")
@click.option("--comm", multiple=True, help="Extra communication-kernel pattern (regex; repeatable).")
def export_trace_cmd(store: str, run_name: str, ranks: str | None, output: str | None, comm: tuple[str, ...]) -> None:
    """Write the run's traces as one Chrome Trace Event Format file (open it in ui.perfetto.dev):
    one process per rank, clocks aligned by the matched collectives, FX node / module names and
    source lines in each mapped kernel's args, collectives linked across ranks by flow arrows.
    STORE: a SQLite file or a PostgreSQL URL ($GRAPHDECK_STORE). Asked ranks without a usable trace
    (a rank whose trace was never ingested, or failed) are left out and named with the reason, for
    the default "all" as for a list. Exit 2 on a bad --ranks (naming the ranks), ranks not in the
    run, none of the asked ranks with a trace, an unknown run or store."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.traces.analyze import CommRule
    from graphdeck.analysis.traces.export import export_trace
    from graphdeck.errors import UsageError
    from graphdeck.store.db import open_engine

    t0 = time.perf_counter()
    try:
        for p in comm:
            try:
                re.compile(p)
            except re.error as exc:
                raise UsageError(f"--comm {p!r} is not a regular expression: {exc}") from exc
        engine = open_engine(_store_arg(store), read_only=True)
        with Session(engine) as s:
            run = _find_run(s, run_name, store)
            out = output or default_output(run.name)
            stats = export_trace(s, run.id, out, ranks, CommRule(extra=comm))
        engine.dispose()
    except GraphdeckError as exc:
        _fail(exc)
    except OSError as exc:
        click.echo(f"error: cannot write {output}: {exc}", err=True)
        sys.exit(2)
    offs = ", ".join(f"r{r} {o['offset_ns'] / 1e3:+.3f} us ({o['method']})" for r, o in stats["offsets"].items())
    click.echo(f"wrote {out}: {len(stats['ranks'])} ranks, {stats['X']:,} slices, {stats['i']:,} instants, "
               f"{stats['events_with_nodes']:,} linked to FX nodes, {stats['collectives_linked']:,} collectives "
               f"linked by {stats['flows']:,} flows ({stats['bytes'] / 2**20:.1f} MiB JSON, "
               f"{time.perf_counter() - t0:.1f}s)")
    click.echo(f"clock offsets: {offs}")
    if stats["skipped"]:
        from graphdeck.analysis.traces.collectives import rank_spans

        by_why: dict[str, list[int]] = {}
        for r, why in sorted(stats["skipped"].items()):
            by_why.setdefault(why, []).append(r)
        click.echo("skipped rank(s) " + "; ".join(f"{rank_spans(rs)}: {why}" for why, rs in by_why.items()))
    if stats.get("flows_unpaired"):
        click.echo(f"{stats['flows_unpaired']:,} flows left out: a collective's slice was not found on one of "
                   "its two ranks")


COMMANDS = (export_trace_cmd,)
