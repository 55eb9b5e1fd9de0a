"""``graphdeck diff-runs``: run B against run A as a CI gate (issue 21 item 2; NOTE: [Run diff] in
graphdeck/analysis/diff/runs.py). Registered on the ``graphdeck`` group by graphdeck/cli.py
(:data:`COMMANDS`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from graphdeck.cli_common import _fail, _find_run, _store_arg
from graphdeck.errors import GraphdeckError

DEFAULT_NOISE_K = 3.0
DEFAULT_MIN_NS = 50_000  # graphdeck.analysis.diff.times.DEFAULT_MIN_NS


@click.command("diff-runs")
@click.argument("store")
@click.argument("run_a")
@click.argument("run_b")
@click.option("--store-b", default=None, help="Store holding RUN_B (default: STORE).")
@click.option("--max-new-graph-breaks", type=click.IntRange(min=0), default=None,
              help="Fail when run B has more new user-code graph breaks (by reason class and source line).")
@click.option("--max-new-recompiles", type=click.IntRange(min=0), default=None,
              help="Fail when run B's frames recompile more times in total than run A's, by more than N.")
@click.option("--max-node-regression-pct", type=click.FloatRange(min=0), default=None,
              help="Fail when a node (or module) is slower beyond the noise floor by more than P percent.")
@click.option("--min-regression-ns", type=click.IntRange(min=0), default=DEFAULT_MIN_NS, show_default=True,
              help="A node-time difference below this many ns per step is never a regression.")
@click.option("--noise-k", type=click.FloatRange(min=0), default=DEFAULT_NOISE_K, show_default=True,
              help="A regression must exceed K x run A's step-to-step spread (3/4 of run B's steps beyond it).")
@click.option("--max-peak-memory-increase-pct", type=click.FloatRange(min=0), default=None,
              help="Fail when a rank's graph-derived step peak grew by more than P percent.")
@click.option("--fail-on-new-divergence", is_flag=True, help="Fail on a rank divergence run A does not have.")
@click.option("--fail-on-new-grad-findings", is_flag=True, help="Fail on a gradient-path finding run A does not have.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text for people, json for scripts.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the gates as JUnit XML to this file (for CI systems).")
@click.option("--allow-incomplete", is_flag=True, help="Exit 0 instead of 3 when a gate's evidence is missing.")
def diff_runs_cmd(store: str, run_a: str, run_b: str, store_b: str | None, max_new_graph_breaks: int | None,
                  max_new_recompiles: int | None, max_node_regression_pct: float | None, min_regression_ns: int,
                  noise_k: float, max_peak_memory_increase_pct: float | None, fail_on_new_divergence: bool,
                  fail_on_new_grad_findings: bool, fmt: str, junit_path: str | None, allow_incomplete: bool) -> None:
    """What changed from RUN_A to RUN_B (names or ids): new or removed graph breaks and recompiles,
    graphs whose structure changed (first differing node), node times per node and module beyond
    the step-to-step noise floor, graph-derived peak memory and saved activations, new rank
    divergences and gradient findings. Exit 0 PASS (nothing found) or WARN (findings no gate
    covers), 1 FAIL (a gate passed), 3 INCOMPLETE (a
    gate's evidence is missing, e.g. no trace in one run for --max-node-regression-pct;
    --allow-incomplete makes it 0), 2 on usage errors or bad input."""
    import json

    from sqlalchemy.orm import Session

    from graphdeck.analysis.diff.runs import Gates, diff_runs
    from graphdeck.analysis.diff.text import to_junit, to_text
    from graphdeck.errors import UsageError
    from graphdeck.store.db import open_engine

    try:
        gates = Gates(max_new_graph_breaks=max_new_graph_breaks, max_new_recompiles=max_new_recompiles,
                      max_node_regression_pct=max_node_regression_pct,
                      max_peak_memory_increase_pct=max_peak_memory_increase_pct,
                      fail_on_new_divergence=fail_on_new_divergence, fail_on_new_grad_findings=fail_on_new_grad_findings,
                      noise_k=noise_k, min_regression_ns=min_regression_ns)
        engine_a = open_engine(store, read_only=True)
        same = store_b is None or _store_arg(store_b) == _store_arg(store)
        engine_b = engine_a if same else open_engine(store_b, read_only=True)
        with Session(engine_a) as sa, Session(engine_b) as sb:
            ra, rb = _find_run(sa, run_a, store), _find_run(sb, run_b, store_b or store)
            if same and ra.id == rb.id:
                raise UsageError(f"RUN_A and RUN_B are the same run ({ra.name!r}); give another run or --store-b")
            report = diff_runs(sa, ra, sb, rb, gates, same_store=same)
    except GraphdeckError as exc:
        _fail(exc)
    click.echo(to_text(report) if fmt == "text" else json.dumps(report.to_dict(), indent=1, default=str))
    if junit_path:
        try:
            Path(junit_path).write_text(to_junit(report))
        except OSError as exc:
            _fail(UsageError(f"cannot write JUnit XML to {junit_path}: {exc.strerror or exc}"))
    sys.exit({"PASS": 0, "WARN": 0, "FAIL": 1, "INCOMPLETE": 0 if allow_incomplete else 3}[report.verdict])


COMMANDS = (diff_runs_cmd,)
