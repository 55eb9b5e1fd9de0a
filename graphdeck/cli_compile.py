"""``graphdeck check-compile``: compile health of a run as a CI gate (issue 21 item 1; NOTE:
[Compile health] in graphdeck/analysis/compilation/health.py). Registered on the
``graphdeck`` group by graphdeck/cli.py (:data:`COMMANDS`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from graphdeck.cli_common import _fail, _find_run, store_and_run
from graphdeck.errors import GraphdeckError


@click.command("check-compile")
@store_and_run()
@click.option("--max-graph-breaks", type=click.IntRange(min=0), default=None,
              help="Fail when the run has more distinct graph breaks in user code (by reason class and "
                   "source line; breaks inside torch/stdlib such as DDP's are not counted).")
@click.option("--max-recompiles-per-frame", type=click.IntRange(min=0), default=None,
              help="Fail when one frame (code object) recompiled more times on any rank.")
@click.option("--fail-on-eager-fallback", is_flag=True,
              help="Fail when a frame fell back to eager (recompile limit hit, a graph break Dynamo could not "
                   "handle, a failed compile).")
@click.option("--fail-on-ddp-no-overlap", is_flag=True,
              help="Fail when compiled DDP runs one backward graph for several gradient buckets (optimize_ddp=False): "
                   "no all-reduce overlaps the backward.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text for people, json for scripts.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the gates as JUnit XML to this file (for CI systems).")
@click.option("--allow-incomplete", is_flag=True, help="Exit 0 instead of 3 when evidence is missing.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json (as every check takes it).")
def check_compile(store: str, run_name: str, max_graph_breaks: int | None, max_recompiles_per_frame: int | None,
                  fail_on_eager_fallback: bool, fail_on_ddp_no_overlap: bool, fmt: str, junit_path: str | None, allow_incomplete: bool,
                  as_json: bool = False) -> None:
    """Graph breaks, recompile budgets, eager fallbacks, restarts, compile time and cache hits of a
    run, per rank and in total. Exit 0 PASS or WARN (a hit recompile limit, an eager fallback, a
    failed compile or compiled DDP that cannot overlap its all-reduces, that no gate covers), 1 FAIL (a threshold passed), 3 INCOMPLETE (nothing
    failed but evidence is missing: a rank without compile records, records dropped on import, a
    compile that never finished; --allow-incomplete makes it 0), 2 on usage errors or bad input."""
    import json

    from sqlalchemy.orm import Session

    from graphdeck.analysis.compilation.health import Thresholds, compile_health
    from graphdeck.analysis.compilation.text import to_junit, to_text
    from graphdeck.store.db import open_engine

    try:
        engine = open_engine(store, read_only=True)
        with Session(engine) as s:
            report = compile_health(s, _find_run(s, run_name, store), Thresholds(
                max_graph_breaks=max_graph_breaks, max_recompiles_per_frame=max_recompiles_per_frame,
                fail_on_eager_fallback=fail_on_eager_fallback, fail_on_ddp_no_overlap=fail_on_ddp_no_overlap))
    except GraphdeckError as exc:
        _fail(exc)
    fmt = "json" if as_json else fmt
    click.echo(to_text(report) if fmt == "text" else json.dumps(report.to_dict(), indent=1, default=str))
    if junit_path:
        Path(junit_path).write_text(to_junit(report))
    sys.exit({"PASS": 0, "WARN": 0, "FAIL": 1, "INCOMPLETE": 0 if allow_incomplete else 3}[report.verdict])


COMMANDS = (check_compile,)
