"""The ``graphdeck`` command: thin commands over library functions.

Exit codes: 0 ok, 1 a check failed (or an internal error), 2 usage or bad input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from graphdeck.errors import BadInputError, GraphdeckError

DEFAULT_STORE = "graphdeck.db"


def _store_arg(store: str) -> str:
    """A ``--store`` value: a SQLAlchemy URL (``postgresql+psycopg://...``) as given, a path made absolute."""
    return store if "://" in store else str(Path(store).resolve())


def _fail(exc: GraphdeckError) -> None:
    click.echo(f"error: {exc.message}", err=True)
    sys.exit(exc.exit_code)


@click.group()
@click.version_option(package_name="graphdeck")
def main() -> None:
    """graphdeck: a debugger for compiled graphs in distributed PyTorch training."""


@main.command()
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


def port_free(host: str, port: int) -> int:
    """``port`` (or, for 0, a port the OS picks) when a server can bind ``host:port`` now, else 0."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, port))
            return sock.getsockname()[1]
    except OSError:
        return 0


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


@main.command()
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
@click.option("--create", is_flag=True, help="Create an empty SQLite store when STORE does not exist "
                                             "(without it, a missing file is an error: a mistyped name).")
def serve(store: str, host: str, port: int, data_dir: str | None, max_upload_bytes: int | None,
          max_decompressed_bytes: int | None, max_decompress_ratio: float | None, upload_ttl_s: float | None,
          create: bool) -> None:
    """Serve the dashboard and API over STORE (a SQLite file or a PostgreSQL URL; $GRAPHDECK_STORE).

    \b
    Environment (an option given on the command line wins):
      GRAPHDECK_STORE                   the store, when STORE is not given
      GRAPHDECK_WRITE_TOKENS            comma-separated tokens that may upload (none: loopback only)
      GRAPHDECK_READ_TOKENS             comma-separated tokens that may read (none: reads are open)
      GRAPHDECK_DATA_DIR                --data-dir
      GRAPHDECK_MAX_UPLOAD_BYTES        --max-upload-bytes
      GRAPHDECK_MAX_DECOMPRESSED_BYTES  --max-decompressed-bytes
      GRAPHDECK_MAX_DECOMPRESS_RATIO    --max-decompress-ratio
      GRAPHDECK_UPLOAD_TTL_S            --upload-ttl-s
      GRAPHDECK_STORE_MAX_BYTES         SQLite only: a size quota on the store (507 when reached)
    """
    from graphdeck.server.app import serve as serve_app

    store_path = _store_arg(store)
    if "://" not in store_path and not Path(store_path).exists() and not create:
        from graphdeck.errors import UsageError

        _fail(UsageError(f"no store at {store_path}: check the path (or pass --create to serve a new, empty store)"))
    given = {"data_dir": data_dir, "max_upload_bytes": max_upload_bytes,
             "max_decompressed_bytes": max_decompressed_bytes, "max_decompress_ratio": max_decompress_ratio,
             "upload_ttl_s": upload_ttl_s}
    try:
        serve_app(store_path, host=host, port=port, **{k: v for k, v in given.items() if v is not None},
                  announce=lambda: click.echo(f"[graphdeck] dashboard: http://{host}:{port}/"))
    except GraphdeckError as exc:  # e.g. a store written by a newer graphdeck: refuse to start
        _fail(exc)


@main.command("check-grads")
@click.argument("store", default=DEFAULT_STORE)
@click.option("--run", "run_name", default=None, help="Run name or id (graph mode, over STORE).")
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

    Graph mode: STORE --run NAME. Eager mode: --model module:factory --inputs SPEC [--loss module:fn];
    --numeric also compares compiled and eager gradients, under --autocast DTYPE or the context
    recorded for --context-from STORE --run NAME.
    Exit 0 PASS, 1 FAIL, 3 INCOMPLETE (nothing failed, but the evidence does not cover every rank,
    step or parameter: see the report's "INCOMPLETE" lines; --allow-incomplete makes it 0), 2 on
    usage errors. Combined: --combine rank0.json --combine rank1.json (exit 2: a file unreadable).
    """
    from graphdeck.analysis.gradients import validate_backward
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
            from graphdeck.analysis.grad_inputs import load_ref, parse_inputs

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
    ``analysis.grad_report.combine``). Reports that all claim the same single rank (eager mode
    without a process group says rank 0) are numbered by file order, with a note. Raises
    ``UsageError`` for an unreadable file, one that is not a report, or --run/--model given too."""
    from graphdeck.analysis.grad_report import GradReport, combine
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
    from graphdeck.analysis.grad_numeric import caller_context, context_options

    ctx = None
    if store:
        from sqlalchemy.orm import Session

        from graphdeck.store.db import open_engine

        with Session(open_engine(store, read_only=True)) as s:
            ctx = caller_context(s, _find_run(s, run_name, store))
    return context_options(ctx, inputs, autocast=autocast, autocast_device=autocast_device,
                           run=run_name if store else None)


@main.command("check-ranks")
@click.argument("store", default=DEFAULT_STORE)
@click.option("--run", "run_name", required=True, help="Run name or id.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "junit"]), default="text", show_default=True,
              help="text for people, json for scripts, junit (JUnit XML) for CI systems.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="Write the report to this file instead of standard output.")
def check_ranks(store: str, run_name: str, fmt: str, output: str | None) -> None:
    """Cross-rank consistency of a run: exit 1 when ranks compiled different graphs, would issue
    different collectives (a predicted hang) or their Flight Recorder dumps show a mismatched
    collective (joined to the compile records that explain it), 3 (INCOMPLETE) when nothing
    differs but evidence is missing (a dropped record, a rank without a dump), 0 when all ranks
    agree, 2 on usage errors."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks import rank_report
    from graphdeck.store.db import open_engine

    try:
        engine = open_engine(store, read_only=True)
        with Session(engine) as s:
            report = rank_report(s, _find_run(s, run_name, store))
    except GraphdeckError as exc:
        _fail(exc)
    text = {"text": report.to_text, "json": report.to_json, "junit": report.to_junit}[fmt]()
    if output:
        Path(output).write_text(text)
    else:
        click.echo(text)
    sys.exit({"OK": 0, "FAIL": 1, "INCOMPLETE": 3}[report.verdict])


def _is_kineto(path: str) -> bool:
    """A Kineto / Chrome trace by its first bytes (``traceEvents`` or ``schemaVersion`` near the start)."""
    from graphdeck.store.fr_import import file_head

    head = file_head(path)
    return head.lstrip()[:1] == b"{" and (b'"traceEvents"' in head or b'"schemaVersion"' in head)


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


@main.command("memory")
@click.argument("run_name")
@click.argument("graph_id", type=int)
@click.option("--store", default=DEFAULT_STORE, show_default=True)
@click.option("--scope", type=click.Choice(["step", "graph"]), default=None,
              help="step: the graph's forward then backward graph (one training step; the default, as on the "
                   "memory page, falling back to the graph alone when it has no forward/backward pair); "
                   "graph: this graph alone.")
@click.option("--step", is_flag=True, hidden=True, help="Same as --scope step (kept for old scripts).")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Holders (and saved activations) to list at the peak.")
@click.option("--checkpoint", "checkpoint_module", default=None, help="Estimate checkpointing this module path.")
@click.option("--dtype", default=None, help="Estimate activations stored in this dtype (e.g. bfloat16).")
def memory_cmd(run_name: str, graph_id: int, store: str, scope: str | None, step: bool, top: int,
               checkpoint_module: str | None, dtype: str | None) -> None:
    """Graph-derived memory of GRAPH_ID (of run RUN_NAME): the peak, where it occurs and its top
    holders by module path; optionally a checkpointing or dtype what-if for its step."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.memory import (
        checkpoint_estimate,
        dtype_estimate,
        forward_backward_pair,
        graph_memory,
        step_memory,
    )
    from graphdeck.errors import NotFoundError
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Graph

    try:
        with Session(open_engine(store, read_only=True)) as s:
            run = _find_run(s, run_name, store)
            graph = s.get(Graph, graph_id)
            if graph is None or graph.run_id != run.id:
                raise NotFoundError(f"graph {graph_id} not found in run {run.name!r}")
            asked_step = step or scope == "step" or bool(checkpoint_module or dtype)
            pair = None
            if scope != "graph":
                try:
                    pair = forward_backward_pair(s, graph_id)
                except NotFoundError:
                    if asked_step:
                        raise
                    click.echo(f"(graph {graph_id} has no forward/backward pair: this graph alone)")
            if pair is not None:
                fw, bw = pair
                # The what-ifs first: a bad --checkpoint or --dtype fails before any report is printed.
                estimates = ([checkpoint_estimate(s, fw, bw, checkpoint_module)] if checkpoint_module else []) + \
                    ([dtype_estimate(s, fw, bw, dtype)] if dtype else [])
                curve = step_memory(s, fw, bw)
                what = f"step (forward {fw} + backward {bw})"
            else:
                estimates = []
                curve = graph_memory(s, graph_id)
                what = f"graph {graph_id} ({graph.kind})"
            click.echo(f"{what}: peak {_mib(curve.peak_bytes)} at node {curve.peak_node} "
                       f"(#{curve.peak_index} of {len(curve.nodes)})")
            click.echo("  by kind: " + ", ".join(f"{k} {_mib(v)}" for k, v in sorted(curve.by_kind_at_peak.items())))
            click.echo("  top holders at the peak (module path, bytes, tensors):")
            for h in curve.top_holders(top):
                click.echo(f"    {h.module_path:<48s} {_mib(h.size_bytes):>12s} {h.tensors:>5d}")
            if curve.saved:
                click.echo(f"  saved activations: {_mib(sum(x['size_bytes'] for x in curve.saved))} in {len(curve.saved)} tensors"
                           + f"; the largest {min(top, len(curve.saved))} and the backward node that frees each:")
                for x in sorted(curve.saved, key=lambda x: -x["size_bytes"])[:top]:
                    freed = f"freed by {x['freed_by']}" if x["freed_by"] else "held past the step"
                    click.echo(f"    {x['name']} ({_mib(x['size_bytes'])}) -> {freed}")
            for est in estimates:
                click.echo(f"  what-if {est.what}: peak {_mib(est.baseline_peak_bytes)} -> {_mib(est.estimated_peak_bytes)}"
                           f" (saves {_mib(est.saving_bytes)}; {est.note})".rstrip("; )") + ")")
                if est.peak_phase:
                    click.echo(f"    estimated peak at {est.estimated_peak_node} ({est.peak_phase})")
    except GraphdeckError as exc:
        _fail(exc)


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


@main.command("replay")
@click.argument("run_name")
@click.argument("graph_id", type=int)
@click.option("--store", default=DEFAULT_STORE, show_default=True, help="SQLite store (read, and traces written).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help='Executor config JSON {"executor": {"num_workers", "graph_partition_strategy", '
                   '"pipeline_microbatch_size", "communication_backend", "enable_heterogeneous_fusion"}}; '
                   "a flag given on the command line overrides the file, the file overrides the defaults.")
@click.option("--workers", default=1, show_default=True, help="Pipeline stages, one worker process each.")
@click.option("--strategy", type=click.Choice(["layerwise", "memory_aware", "auto"]), default="layerwise",
              show_default=True, help="How the graph is cut into stages.")
@click.option("--microbatches", default=4, show_default=True, help="Microbatches streamed through the pipeline.")
@click.option("--microbatch-size", type=click.IntRange(min=1), default=None,
              help="Rows per microbatch (default: the captured batch); refused, naming the node, when a static "
                   "shape in the graph fixes the batch size.")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default=None, help="Default: gloo on CPU, nccl on CUDA.")
@click.option("--heterogeneous-fusion/--no-heterogeneous-fusion", "heterogeneous_fusion", default=None,
              help="Run the CPU- and GPU-placed segments of a mixed graph fused on --device (refused, with the "
                   "reason, on a graph recorded on one device type).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True, help="Where nodes run.")
@click.option("--iters", default=3, show_default=True, help="Profiled iterations of a one-worker run.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole summary as JSON.")
@click.pass_context
def replay_cmd(ctx: click.Context, run_name: str, graph_id: int, store: str, config_path: str | None, workers: int,
               strategy: str, microbatches: int, microbatch_size: int | None, backend: str | None,
               heterogeneous_fusion: bool | None, device: str, iters: int, as_json: bool) -> None:
    """Re-run stored graph GRAPH_ID of RUN_NAME with synthetic inputs: one worker under the profiler
    (a trace mapped onto its nodes), or split into stages pipelined over --workers processes."""
    from sqlalchemy.orm import Session

    from graphdeck.errors import NotFoundError
    from graphdeck.replay.config import load_config, merge
    from graphdeck.replay.pipeline import replay
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Graph

    try:
        settings = {"workers": workers, "strategy": strategy, "microbatch_size": microbatch_size, "backend": backend,
                    "heterogeneous_fusion": heterogeneous_fusion}
        if config_path:  # flags on the command line > the file > defaults
            given = {k for k in settings if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE}
            settings = merge(load_config(config_path), settings, given)
        engine = open_engine(store, create=False)
        with Session(engine) as s:
            run = _find_run(s, run_name, store)
            graph = s.get(Graph, graph_id)
            if graph is None or graph.run_id != run.id:
                raise NotFoundError(f"graph {graph_id} not found in run {run.name!r}")
        out = replay(engine, graph_id, microbatches=microbatches, device=device, iters=iters, **settings)
    except GraphdeckError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
        return
    ex = out.get("executor")
    if ex:
        times = ex["node_gpu_ns"] or ex["node_cpu_ns"]
        recorded = (f"compared with recorded trace {ex['recorded_trace_id']}" if ex.get("recorded_trace_id") is not None
                    else "no recorded trace of this run maps onto the graph: nothing to compare with")
        click.echo(f"executor: trace {ex['trace_id']}, {len(times)} nodes timed on {device} "
                   f"(mean of {ex['iters']} runs; {recorded})")
        for name, ns in sorted(times.items(), key=lambda kv: -kv[1])[:10]:
            ratio = ex["ratio"].get(name)
            click.echo(f"  {name:<40s} {ns / 1e3:>10.1f} us" + (f"  x{ratio:.2f} vs recorded" if ratio else ""))
    if "pipeline" in out:
        p, plan = out["pipeline"], out["plan"]
        cost = {"layerwise": "compute nodes", "memory_aware": "input bytes", "auto": "measured node time"}.get(
            plan["strategy"], "cost")
        click.echo(f"plan {plan['strategy']}: {len(plan['stages'])} stages; balance {plan['balance']:.2f} = the "
                   f"largest stage's {cost} / the mean stage's (1.00 is even)"
                   + (f"; by estimated time {plan['time_balance']:.2f}" if plan.get("time_balance") else ""))
        for st, busy in zip(plan["stages"], p["busy_ns"]):
            click.echo(f"  stage {st['index']}: {st['compute_nodes']} nodes, params {_mib(st['param_bytes'])}, "
                       f"activations {_mib(st['activation_bytes'])}, sends {len(st['send'])}, busy {busy / 1e6:.1f} ms")
        click.echo(f"pipeline ({p['backend']}, {p['microbatches']} microbatches of {out['batch']['replayed']} rows): "
                   f"makespan {p['makespan_ns'] / 1e6:.1f} ms, bubble {p['bubble_fraction']:.1%}, traces {p['trace_ids']}")
    for seg in (out.get("heterogeneous_fusion") or {}).get("segments", []):
        click.echo(f"  fused on {device}: {seg['device_type']} segment {seg['first']}..{seg['last']} "
                   f"({seg['nodes']} nodes) in stage(s) {seg['stages']}")


@main.command("ingest-trace")
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--store", default=DEFAULT_STORE, show_default=True,
              help="Store to write: a SQLite file or a PostgreSQL URL.")
@click.option("--run", "run_name", required=True, help="Run name (created if missing).")
@click.option("--rank", type=int, default=None, help="Rank, when the trace does not say.")
@click.option("--strict", is_flag=True, help="Fail, keeping nothing, on any dropped event.")
@click.option("--replace", is_flag=True,
              help="The run holds the same file (same bytes) already: replace that trace instead of refusing.")
@click.option("--json", "as_json", is_flag=True, help="Print every counter of the ingest as JSON.")
def ingest_trace_cmd(trace_file: str, store: str, run_name: str, rank: int | None, strict: bool, replace: bool,
                     as_json: bool) -> None:
    """Stream a Kineto trace (.json or .json.gz) into the store (the upload API's code path).
    The same file twice into one run is refused (exit 2) unless ``--replace``."""
    from sqlalchemy.orm import Session
    from tqdm import tqdm

    from graphdeck.store.db import open_engine, undo_new_run_on_error
    from graphdeck.store.schema import Trace
    from graphdeck.store.traces import ingest_trace, summary_line

    try:
        engine = open_engine(_store_arg(store))
    except GraphdeckError as exc:  # not a store, or one of a newer schema
        _fail(exc)
    bar = tqdm(total=os.path.getsize(trace_file), unit="B", unit_scale=True, desc="ingest", file=sys.stderr,
               disable=None)
    try:
        with undo_new_run_on_error(engine, run_name):  # a failed ingest leaves no empty run behind
            result = ingest_trace(engine, trace_file, run_name=run_name, rank=rank, strict=strict,
                                  progress=lambda n: bar.update(n - bar.n),
                                  duplicate="replace" if replace else "refuse")
    except GraphdeckError as exc:
        bar.close()
        if exc.details.get("kept") and exc.details.get("trace_id") is not None:
            # Not strict and the file is cut: the events before the cut are stored (status
            # 'truncated'); that is what was asked, so it is a warning with the summary, exit 0.
            click.echo(f"warning: {exc}", err=True)
            with Session(engine) as s:
                trace = s.get(Trace, exc.details["trace_id"])
                run_id, trace_rank = trace.run_id, trace.rank
            from graphdeck.analysis.trace_map import link_kernels

            link_kernels(engine, run_id)
            click.echo(f"trace {exc.details['trace_id']}: rank {trace_rank}, status truncated: "
                       + summary_line(exc.details.get("stats") or {}))
            if as_json:
                click.echo(json.dumps(exc.details.get("stats") or {}, indent=2, default=str))
            return
        if exc.details.get("stats"):
            click.echo(json.dumps(exc.details["stats"], indent=2, default=str), err=True)
        _fail(exc)
    bar.update(bar.total - bar.n)
    bar.close()
    from graphdeck.analysis.trace_map import link_kernels  # kernel -> FX node links of the run

    link_kernels(engine, result.run_id)
    kernels = (result.stats or {}).get("gpu_kernels")
    click.echo(f"trace {result.trace_id}: rank {result.rank}, status {result.status}: " + summary_line(result.stats or {})
               + (f"; {kernels} GPU kernels" if kernels is not None else ""))
    if result.status in ("ok", "truncated"):
        from graphdeck.analysis.trace_map import map_trace

        with Session(engine) as s:
            m = map_trace(s, result.trace_id)
        if m.kernel_ns:
            by = ", ".join(f"{n} {src}" for src, n in sorted(m.sources.items()))
            what = "CPU time of compiled regions" if m.device == "cpu" else "GPU kernel time"
            click.echo(f"{m.mapped_ns / m.kernel_ns:.1%} of its {what} maps to graph nodes"
                       + (f" ({by} kernels)" if by else " (no capture of this run/rank links kernels to nodes)"))
            from graphdeck.analysis.kernel_source_nodes import coverage_warning

            if (low := coverage_warning(m)) is not None:
                click.echo(f"warning: {low}", err=True)
    if as_json:
        click.echo(json.dumps(result.stats, indent=2, default=str))


@main.command("memory-snapshot")
@click.argument("snapshot", type=click.Path(exists=True, dir_okay=False))
@click.option("--store", default=DEFAULT_STORE, show_default=True, help="Store holding the run's compile records.")
@click.option("--run", "run_name", default=None, help="Run whose Inductor output code names the graphs (optional).")
@click.option("--device", type=int, default=0, show_default=True, help="CUDA device index in the snapshot.")
@click.option("--top", type=int, default=10, show_default=True, help="Places to list at the peak.")
def memory_snapshot_cmd(snapshot: str, store: str, run_name: str | None, device: int, top: int) -> None:
    """Replay a CUDA memory snapshot pickle (torch.cuda.memory._dump_snapshot) and print its
    measured peak and who holds the bytes then, on the run's graph nodes where Inductor code
    allocated them (graphdeck.analysis.memory_measured)."""
    from graphdeck.analysis.memory_measured import load_snapshot, measure, output_code_files
    from graphdeck.errors import UsageError

    try:
        snap = load_snapshot(snapshot)
        code = {}
        if run_name is not None:
            from sqlalchemy import select
            from sqlalchemy.orm import Session

            from graphdeck.store.db import open_engine
            from graphdeck.store.schema import Run

            engine = open_engine(_store_arg(store))
            with Session(engine) as s:
                run_id = s.scalar(select(Run.id).where(Run.name == run_name))
            if run_id is None:
                raise UsageError(f"no run named {run_name!r} in {store}")
            code = output_code_files(engine, run_id)
        m = measure(snap, code, device=device)
    except GraphdeckError as exc:
        _fail(exc)
    mib = 2 ** 20
    click.echo(f"device {m.device}: measured peak {m.peak_bytes / mib:,.1f} MiB ({m.baseline_bytes / mib:,.1f} MiB "
               f"allocated before the history); {m.attributed} of {m.allocations} allocations on graph nodes")
    click.echo("at the peak: " + ", ".join(f"{k} {v / mib:,.1f} MiB" for k, v in
                                           sorted(m.by_category_bytes.items(), key=lambda kv: -kv[1])))
    for size, where in m.at_peak[:top]:
        label = (f"graph {where[1]}: {', '.join(where[2][:6]) or '(no source nodes)'}" if where[0] == "graph"
                 else where[0])
        click.echo(f"  {size / mib:10,.1f} MiB  {label}")


@main.command("import")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--store", default=DEFAULT_STORE, show_default=True,
              help="Store to write: a SQLite file or a PostgreSQL URL.")
@click.option("--run", "run_name", required=True, help="Run name (created if missing).")
@click.option("--strict", is_flag=True, help="Fail, keeping nothing, on any dropped record.")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when it is a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Also print every counter of the TORCH_TRACE import as JSON.")
def import_cmd(paths: tuple[str, ...], store: str, run_name: str, strict: bool, progress: bool | None,
               as_json: bool) -> None:
    """Import TORCH_TRACE compile logs (one per rank), Flight Recorder dumps (pickle or JSON, any
    file names; graphdeck.store.fr_import) and Kineto traces (by content) of one job — files or
    directories — as run RUN."""
    from graphdeck.store.db import open_engine
    from graphdeck.store.fr_import import discover, import_flight_dumps, sniff
    from graphdeck.store.torch_trace import import_torch_trace

    try:
        found = discover(paths)
        fr_files = [f for f in found if sniff(f)]
        kineto = [f for f in found if f not in fr_files and _is_kineto(f)]  # profiler traces of the same run
        logs = [p for p in paths if Path(p).is_dir() or str(Path(p)) not in {str(Path(f)) for f in fr_files + kineto}]
        fr = import_flight_dumps(open_engine(store), [], run_name=run_name, strict=strict, files=fr_files) \
            if fr_files else None
        if fr is not None:
            click.echo(f"Flight Recorder: ranks {fr.ranks}, {fr.entries} entries, {fr.dropped} dropped"
                       + (f"; no dump from ranks {fr.missing_ranks}" if fr.missing_ranks else ""))
            for d in fr.dropped_records[:20]:
                click.echo(f"  dropped {d}", err=True)
        try:
            result = import_torch_trace(open_engine(store), logs, run_name=run_name, strict=strict,
                                        progress=sys.stderr.isatty() if progress is None else progress) if logs else None
        except BadInputError as exc:
            if (fr is None and not kineto) or "no TORCH_TRACE log" not in exc.message:
                raise
            if exc.details.get("skipped_files") or "skipped" in exc.message:  # say what else was given
                click.echo(f"  other files: {exc.message}", err=True)
            result = None
        for f in kineto:
            from graphdeck.store.traces import ingest_trace

            t = ingest_trace(open_engine(store), f, run_name=run_name, strict=strict)
            click.echo(f"Kineto trace {Path(f).name}: rank {t.rank}, {t.num_events} events, status {t.status}")
        if kineto:
            from graphdeck.analysis.trace_map import link_kernels

            link_kernels(open_engine(store), t.run_id)
    except GraphdeckError as exc:
        if exc.details.get("stats"):
            click.echo(json.dumps(exc.details["stats"], indent=2, default=str), err=True)
        _fail(exc)
    if result is None:
        return
    st = result.stats
    click.echo(f"run {result.run_name} (id {result.run_id}): ranks {result.ranks}; {st.get('graphs', 0)} graphs, "
               f"{st.get('nodes', 0)} nodes, {st.get('compile_events', 0)} compile events, "
               f"{st.get('kernel_nodes', 0)} kernel links; {result.dropped} dropped")
    for f in result.files:
        if f["rank_mismatch"]:
            click.echo(f"  warning: {Path(f['path']).name}: file name says rank {f['file_rank']}, "
                       f"envelopes say rank {f['envelope_rank']} (stored as rank {f['rank']})", err=True)
    for name in result.skipped_files:
        click.echo(f"  skipped {name}", err=True)
    # Only what went wrong beyond the summary line; every counter with --json (issue 24.8's fault).
    problems = {k: v for k, v in st.items() if isinstance(v, int) and v and k.startswith(
        ("bad_", "dropped", "unknown", "truncated", "other_rank", "orphan", "unparsed", "checksum"))}
    if problems:
        click.echo("  " + ", ".join(f"{k} {v:,}" for k, v in sorted(problems.items())))
    if as_json:
        click.echo(json.dumps(st, indent=2, default=str))


@main.command("upload")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--url", required=True, help="graphdeck server, e.g. http://dash:8765.")
@click.option("--run", "run_name", required=True, help="Run to add to on the server (created if missing).")
@click.option("--rank", type=int, default=None, help="Rank, when a trace does not say.")
@click.option("--kind", type=click.Choice(["auto", "trace", "bundle"]), default="auto", show_default=True,
              help="bundle: a SQLite capture store; trace: a Kineto .json/.json.gz; auto: by the file's magic bytes.")
@click.option("--token", default=None, help="Write token (default: $GRAPHDECK_TOKEN).")
@click.option("--chunk-mb", default=8, show_default=True, help="Chunk size in MiB.")
@click.option("--strict", is_flag=True, help="Trace: fail, keeping nothing, on any dropped event.")
def upload_cmd(file: str, url: str, run_name: str, rank: int | None, kind: str, token: str | None, chunk_mb: int,
               strict: bool) -> None:
    """Upload FILE (a capture store or a trace) to a graphdeck server, resuming after failures."""
    from graphdeck.capture.upload import upload_store, upload_trace

    if kind == "auto":
        with open(file, "rb") as f:
            kind = "bundle" if f.read(16) == b"SQLite format 3\x00" else "trace"
    log = lambda msg: click.echo(f"[graphdeck upload] {msg}", err=True)  # noqa: E731
    kw = {"run": run_name, "rank": rank, "token": token, "chunk_bytes": chunk_mb * 1024 * 1024, "log": log}
    try:
        if kind == "bundle":
            status = upload_store(url, file, **kw)
        else:
            status = upload_trace(url, file, strict=strict, **kw)
    except GraphdeckError as exc:
        _fail(exc)
    result = status["result"] or {}
    again = " (already uploaded before)" if result.get("already_merged") else ""
    click.echo(f"uploaded {Path(file).name} as {kind} {status['id']} to run {result.get('run_name')!r} "
               f"(id {result.get('run_id')}){again}")
    click.echo(json.dumps(result, indent=2, default=str))



@main.command("delete-run")
@click.argument("store")
@click.option("--run", "run_name", required=True, help="Name of the run to delete (or its id).")
def delete_run_cmd(store: str, run_name: str) -> None:
    """Delete run RUN and every row of it from STORE (SQLite file or PostgreSQL URL): graphs, nodes,
    traces and their events, parameters, compile records; exit 2 when STORE has no such run."""
    from sqlalchemy.orm import Session

    from graphdeck.errors import NotFoundError
    from graphdeck.store.db import delete_run, display_url, open_engine

    path = _store_arg(store)
    try:
        if "://" not in path and not Path(path).exists():
            raise NotFoundError(f"store {store} does not exist")
        engine = open_engine(path, create=False)
        try:
            with Session(engine) as s:
                run_id = _find_run(s, run_name, display_url(path)).id
            result = delete_run(engine, run_id)
        finally:
            engine.dispose()
    except GraphdeckError as exc:
        _fail(exc)
    rows = ", ".join(f"{n} {table}" for table, n in sorted(result["rows"].items())) or "no rows"
    click.echo(f"deleted run {result['run_name']!r} (id {result['run_id']}) from {display_url(path)}: {rows}")


@main.group("db")
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


@main.command("stack")
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


# Commands defined in their own modules (each imports what it needs when run).
from graphdeck.cli_compile import check_compile as _check_compile  # noqa: E402
from graphdeck.cli_diff import diff_runs_cmd as _diff_runs  # noqa: E402
from graphdeck.cli_export import export_trace_cmd as _export_trace  # noqa: E402
from graphdeck.cli_summary import summary_cmd as _summary  # noqa: E402

for _command in (_check_compile, _diff_runs, _summary, _export_trace):
    main.add_command(_command)

if __name__ == "__main__":
    main()
