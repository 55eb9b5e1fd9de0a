"""``graphdeck check-grads`` and ``graphdeck check-ranks``: the CI checks of gradient paths and
cross-rank consistency. Registered on the ``graphdeck`` group by graphdeck/cli.py
(:data:`COMMANDS`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from graphdeck.cli_common import _fail, _find_run, store_and_run
from graphdeck.errors import GraphdeckError


@click.command("check-grads")
@store_and_run(run_required=False, run_help="Run name or id (graph mode, over STORE).")
@click.option("--model", "model_ref", default=None, help="module:factory returning the nn.Module (eager mode).")
@click.option("--inputs", "input_specs", multiple=True,
              help="Eager-mode input: DTYPE[d0,..] (float32[4,8]), DTYPE[..]<HIGH (int64[2,16]<256), "
                   "NAME=SPEC, or module:fn returning the inputs; repeat per input.")
@click.option("--loss", "loss_ref", default=None, help="module:fn(output) -> scalar loss (eager; default output.loss or sum).")
@click.option("--numeric", is_flag=True, help="Eager mode: also compare compiled and eager gradients.")
@click.option("--backend", default="aot_eager", show_default=True, help="torch.compile backend for --numeric.")
@click.option("--autocast", "autocast", default=None, metavar="DTYPE",
              help="--numeric: run forward and loss under torch.autocast(dtype=DTYPE) (bfloat16, float16; off), "
                   "as the training step does. Default: from --context-from, else off.")
@click.option("--autocast-device", "autocast_device", default=None, metavar="TYPE",
              help="--numeric: device type for --autocast (cpu, cuda). Default: the inputs' device.")
@click.option("--context-from", "context_from", default=None, metavar="STORE",
              help="--numeric: take autocast and grad mode from the Dynamo graphs of --run NAME in STORE "
                   "(what the capture recorded) where no --autocast is given.")
@click.option("--allow", "allow", multiple=True, help="fnmatch pattern of parameters unused on purpose (repeatable).")
@click.option("--buffers", is_flag=True, help="List buffers too (status BUFFER).")
@click.option("--expect-params", "expect_params", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Graph mode: file of parameter names (one per line) every rank should have (imported logs).")
@click.option("--allow-incomplete", "allow_incomplete", is_flag=True,
              help="Graph mode: pass (exit 0) when nothing failed although the evidence is incomplete.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "junit"]), default="text", show_default=True,
              help="Output format.")
@click.option("--output", "-o", "output", type=click.Path(dir_okay=False), default=None,
              help="Write the report to this file (text still goes to stdout).")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("--combine", "combine_files", multiple=True, type=click.Path(dir_okay=False), metavar="REPORT.json",
              help="Combine per-rank reports written with --format json -o (repeat per rank): rows and findings "
                   "of all, plus rank-divergence findings; no --run/--model.")
def check_grads(store: str, run_name: str | None, model_ref: str | None, input_specs: tuple[str, ...],
                loss_ref: str | None, numeric: bool, backend: str, autocast: str | None, autocast_device: str | None,
                context_from: str | None, allow: tuple[str, ...], buffers: bool,
                expect_params: str | None, allow_incomplete: bool, fmt: str, output: str | None,
                as_json: bool, combine_files: tuple[str, ...] = ()) -> None:
    """Gradient-path check for CI: every trainable parameter gets a gradient on every rank.

    Graph mode: STORE --run NAME (or NAME --store STORE). Eager mode: --model module:factory --inputs SPEC [--loss module:fn];
    --numeric also compares compiled and eager gradients, under --autocast DTYPE or the context
    recorded for --context-from STORE --run NAME.
    Exit 0 PASS, 1 FAIL, 3 INCOMPLETE (nothing failed, but the evidence does not cover every rank,
    step or parameter: see the report's "INCOMPLETE" lines; --allow-incomplete makes it 0), 2 on
    usage errors. Combined: --combine rank0.json --combine rank1.json (exit 2: a file unreadable).
    """
    from graphdeck.analysis.gradients.core import validate_backward
    from graphdeck.errors import UsageError

    fmt = "json" if as_json else fmt
    try:
        if model_ref and run_name and not context_from:
            raise UsageError("give either --run (graph mode) or --model (eager mode), not both")
        if context_from and not (model_ref and run_name):
            raise UsageError("--context-from STORE needs --model (eager mode) and --run NAME (the captured run)")
        if (autocast or autocast_device or context_from) and not numeric:
            raise UsageError("--autocast, --autocast-device and --context-from apply to --numeric")
        if combine_files:
            report = _combined_report(combine_files, allow, model_ref or run_name)
        elif model_ref:
            from graphdeck.analysis.gradients.inputs import load_ref, parse_inputs

            if not input_specs:
                raise UsageError("--model needs --inputs (e.g. --inputs float32[4,8])")
            factory = load_ref(model_ref, "--model")
            model = factory() if not hasattr(factory, "named_parameters") else factory
            inputs = parse_inputs(input_specs)
            loss_fn = load_ref(loss_ref, "--loss") if loss_ref else None
            context, notes = _numeric_context(context_from, run_name, inputs, autocast, autocast_device) \
                if numeric else ({}, [])
            for note in notes:
                click.echo(f"[graphdeck] {note}", err=True)
            report = validate_backward(model, inputs, loss_fn, allow=allow, numeric=numeric, backend=backend,
                                       include_buffers=buffers, **context)
            report.notes += notes
        elif run_name:
            expected = None
            if expect_params:
                expected = [ln.strip() for ln in Path(expect_params).read_text().splitlines()
                            if ln.strip() and not ln.startswith("#")]
            report = validate_backward(store, run_name, allow=allow, include_buffers=buffers,
                                       expected_params=expected)
        else:
            raise UsageError("give --run NAME (graph mode over STORE) or --model module:factory --inputs SPEC")
    except GraphdeckError as exc:
        _fail(exc)
    report.allow_incomplete = allow_incomplete
    text = {"text": report.to_text, "json": report.to_json, "junit": report.to_junit}[fmt]()
    if output:
        try:
            Path(output).write_text(text if text.endswith("\n") else text + "\n")
        except OSError as exc:
            _fail(UsageError(f"cannot write the report to {output}: {exc.strerror or exc}"))
        click.echo(report.to_text() if fmt != "text" else text)
    else:
        click.echo(text)
    sys.exit({"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}[report.verdict])


def _combined_report(files: tuple[str, ...], allow: tuple[str, ...], conflicting: str | None):
    """check-grads --combine: one report over per-rank JSON reports (``GradReport.from_json``,
    ``analysis.gradients.report.combine``). Reports that all claim the same single rank (eager mode
    without a process group says rank 0) are numbered by file order, with a note. Raises
    ``UsageError`` for an unreadable file, one that is not a report, or --run/--model given too."""
    from graphdeck.analysis.gradients.report import GradReport, combine
    from graphdeck.errors import UsageError

    if conflicting:
        raise UsageError("--combine reads saved reports: give it without --run or --model")
    reports = []
    for f in files:
        try:
            reports.append(GradReport.from_json(Path(f).read_text()))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--combine {f}: not a readable check-grads JSON report ({exc})") from None
    out = combine(reports, labels=list(files))  # renumbers reports that all say the same rank, in file order
    return out.apply_allow(sorted(set(allow) | {p for rep in reports for p in rep.allow}))


def _numeric_context(store: str | None, run_name: str | None, inputs, autocast: str | None,
                     autocast_device: str | None) -> tuple[dict, list[str]]:
    """check-grads --numeric: autocast/grad-mode keyword arguments from the flags and, with
    ``--context-from``, the context the capture recorded on the run's Dynamo graphs."""
    from graphdeck.analysis.gradients.numeric import caller_context, context_options

    ctx = None
    if store:
        from sqlalchemy.orm import Session

        from graphdeck.store.db import open_engine

        with Session(open_engine(store, read_only=True)) as s:
            ctx = caller_context(s, _find_run(s, run_name, store))
    return context_options(ctx, inputs, autocast=autocast, autocast_device=autocast_device,
                           run=run_name if store else None)


@click.command("check-ranks")
@store_and_run()
@click.option("--format", "fmt", type=click.Choice(["text", "json", "junit"]), default="text", show_default=True,
              help="text for people, json for scripts, junit (JUnit XML) for CI systems.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="Write the report to this file instead of standard output.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json (as every check takes it).")
@click.option("--warn-fraction", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Share of the collective timeout from which a compile skew or a straggler's wait is a WARN "
                   "(default 0.5, WARN_FRACTION); at the timeout, or where the job died, it is a FAIL.")
def check_ranks(store: str, run_name: str, fmt: str, output: str | None, as_json: bool = False,
                warn_fraction: float | None = None) -> None:
    """Cross-rank consistency of a run: exit 1 when ranks compiled different graphs, would issue
    different collectives (a predicted hang) or their Flight Recorder dumps show a mismatched
    collective (joined to the compile records that explain it) or a wait reached the collective
    timeout (a compile skew, a straggler: NOTE: [Time verdicts]), 3 (INCOMPLETE) when nothing
    differs but evidence is missing (a dropped record, a rank without a dump), 0 when all ranks
    agree, 2 on usage errors."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks.core import rank_report
    from graphdeck.store.db import open_engine

    try:
        engine = open_engine(store, read_only=True)
        with Session(engine) as s:
            report = rank_report(s, _find_run(s, run_name, store), warn_fraction)
    except GraphdeckError as exc:
        _fail(exc)
    fmt = "json" if as_json else fmt
    text = {"text": report.to_text, "json": report.to_json, "junit": report.to_junit}[fmt]()
    if output:
        Path(output).write_text(text)
    else:
        click.echo(text)
    sys.exit({"OK": 0, "WARN": 0, "FAIL": 1, "INCOMPLETE": 3}[report.verdict])


@click.command("diff-ranks")
@store_and_run()
@click.option("--graph", "graph", default=None, metavar="GRAPH",
              help="The graph: a key compile_id:kind[:position] such as 0/0:aot_forward, or a graph id of the run "
                   "(default: every graph of the run).")
@click.option("--ranks", default=None, metavar="RANKS", help="Ranks to compare: all (default), or 0,2-5.")
@click.option("--base", "base_rank", type=click.IntRange(min=0), default=None,
              help="Diff against this rank's graph (default: the largest class of identical ranks). Needs --graph.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text for people, json for scripts.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("--no-times", is_flag=True, help="Skip the per-rank node times (one trace mapping per rank).")
def diff_ranks(store: str, run_name: str, graph: str | None, ranks: str | None, base_rank: int | None, fmt: str,
               as_json: bool = False, no_times: bool = False) -> None:
    """The N-way rank diff: one graph across all ranks, ranks grouped into classes of identical
    graphs (by fingerprint), the nodes where a class differs from the base and what it does there,
    the parallel layout's explanation as a NOTE (a pipeline stage, a TP shard, a vocab or expert
    offset), and per-rank node time with --graph. Exit 0 when every rank has the same graph (notes
    allowed; WARN: some ranks lack a graph the others compiled), 1 when ranks differ, 3 (INCOMPLETE)
    when a rank stored no graph, 2 on usage errors."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks.nway import EXIT_CODES, nway_report, nway_reports, report_json, worst
    from graphdeck.errors import UsageError
    from graphdeck.store.db import open_engine

    try:
        if base_rank is not None and graph is None:
            raise UsageError("--base needs --graph (the base rank of one graph)")
        engine = open_engine(store, read_only=True)
        with Session(engine) as s:
            run = _find_run(s, run_name, store)
            reports = ([nway_report(s, run, graph, ranks, base_rank, times=not no_times)] if graph is not None
                       else nway_reports(s, run, ranks))
    except GraphdeckError as exc:
        _fail(exc)
    verdict = worst([r.verdict for r in reports])
    if as_json or fmt == "json":
        click.echo(report_json(reports))
    else:
        for r in reports:
            click.echo(r.to_text() if r.verdict != "OK" or len(reports) == 1 else f"{r.lines()[0]}: {r.lines()[-1]}")
        if len(reports) > 1:
            click.echo({"OK": "OK: every rank has the same graphs", "FAIL": "FAIL: ranks differ",
                        "WARN": "WARN: some ranks lack graphs the others compiled",
                        "INCOMPLETE": "INCOMPLETE: evidence missing"}[verdict]
                       + f" ({sum(r.verdict == 'FAIL' for r in reports)} of {len(reports)} graphs differ)")
    sys.exit(EXIT_CODES[verdict])


COMMANDS = (check_grads, check_ranks, diff_ranks)
