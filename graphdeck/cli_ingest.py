"""Getting data into a store: ``graphdeck ingest-trace``, ``import``, ``upload``, and
``delete-run`` to take a run out again. Registered on the ``graphdeck`` group by
graphdeck/cli.py (:data:`COMMANDS`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from graphdeck.cli_common import DEFAULT_STORE, _fail, _find_run, _is_kineto, _store_arg, store_and_run
from graphdeck.errors import BadInputError, GraphdeckError, UsageError


class _NoBar:
    """tqdm's interface where its bar would be disabled (stderr not a terminal), without loading
    tqdm (and the multiprocessing lock it makes): issue 26 item 4."""

    def __init__(self, total: int) -> None:
        self.n, self.total = 0, total

    def update(self, n: int) -> None:
        self.n += n

    def close(self) -> None:
        pass


def _bar(total_bytes: int):
    """A byte progress bar on stderr when it is a terminal (tqdm's ``disable=None``), else a no-op."""
    if not sys.stderr.isatty():
        return _NoBar(total_bytes)
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="ingest", file=sys.stderr, disable=None)


@click.command("ingest-trace")
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

    from graphdeck.store.db import open_engine, undo_new_run_on_error
    from graphdeck.store.schema import Trace
    from graphdeck.store.traces import ingest_trace, summary_line

    try:
        engine = open_engine(_store_arg(store))
    except GraphdeckError as exc:  # not a store, or one of a newer schema
        _fail(exc)
    from graphdeck.store.trace_export_ingest import is_export

    if is_export(trace_file):  # graphdeck's own multi-rank export: one trace per rank again
        _ingest_export(engine, trace_file, run_name, rank, strict, replace, as_json)
        return
    bar = _bar(os.path.getsize(trace_file))
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
            from graphdeck.analysis.traces.mapping import link_kernels

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
    from graphdeck.analysis.traces.mapping import link_kernels  # kernel -> FX node links of the run

    link_kernels(engine, result.run_id)
    kernels = (result.stats or {}).get("gpu_kernels")
    click.echo(f"trace {result.trace_id}: rank {result.rank}, status {result.status}: " + summary_line(result.stats or {})
               + (f"; {kernels} GPU kernels" if kernels is not None else ""))
    if result.status in ("ok", "truncated"):
        from graphdeck.analysis.traces.headline_map import headline_mapping  # NOTE: [Headline mapping from launches]
        from graphdeck.analysis.traces.idle import TraceEvents, headline, idle_breakdown

        with Session(engine) as s:
            m = headline_mapping(s, result.trace_id)
            # NOTE: [Idle time by cause]: its own lighter read (no args, no launch chains), as the API's
            idle = idle_breakdown(TraceEvents.load(s, result.trace_id))
        if m.kernel_ns:
            click.echo(mapping_headline(m))
            from graphdeck.analysis.traces.kernel_source_nodes import coverage_warning

            if (low := coverage_warning(m)) is not None:
                click.echo(f"warning: {low}", err=True)
        for line in headline(idle):
            click.echo(line)
    if as_json:
        click.echo(json.dumps(result.stats, indent=2, default=str))


def mapping_headline(m) -> str:
    """What a trace's kernel → node mapping covers, each number with what it is of (NOTE: [Trace
    coverage]): on GPU the share of the whole kernel time on FX nodes, the coverage of compiled
    graphs' kernel time, and the time outside graphs by design (the eager optimizer step mapped to
    the step as a whole, never to a node); on CPU the ops' own time in compiled regions."""
    from graphdeck.analysis.traces.coverage import coverage
    from graphdeck.analysis.units import ns_text

    cov = coverage(m)
    by = ", ".join(f"{n} {src}" for src, n in sorted(m.sources.items()) if src != "optimizer step")
    how = f" ({by} kernels)" if by else " (no capture of this run/rank links kernels to nodes)"
    if m.device == "cpu":
        frac = f"{cov.fraction:.1%}" if cov.fraction is not None else "none"
        return (f"{frac} of {cov.covers} maps to FX graph nodes{how}; "
                f"{ns_text(cov.overhead_ns)} between and around those ops is not counted")
    whole = cov.covered_ns / m.kernel_ns
    line = f"{whole:.1%} of its GPU kernel time maps to FX graph nodes{how}"
    if cov.fraction is not None:
        line += f"; that is {cov.fraction:.1%} of {cov.covers}"
    outside = sorted(cov.outside.items(), key=lambda kv: -kv[1])
    if outside:
        steps = ", ".join(m.optimizer_ns)
        line += "; outside compiled graphs: " + ", ".join(
            f"{k}{f' ({steps}, on the step, no node)' if k == 'eager optimizer step' and steps else ''} "
            f"{ns / m.kernel_ns:.1%}" for k, ns in outside)
    return line


def _ingest_export(engine, trace_file: str, run_name: str, rank: int | None, strict: bool, replace: bool,
                   as_json: bool) -> None:
    """``ingest-trace`` of a ``graphdeck export-trace`` file: one trace per rank (pid), NOTE:
    [Export re-ingest] in graphdeck/store/trace_export_ingest.py."""
    from graphdeck.analysis.traces.mapping import link_kernels
    from graphdeck.errors import UsageError
    from graphdeck.store.db import undo_new_run_on_error
    from graphdeck.store.trace_export_ingest import ingest_export
    from graphdeck.store.traces import summary_line

    lines: list[str] = []

    def on_rank(res) -> None:
        lines.append(f"trace {res.trace_id}: rank {res.rank}, status {res.status}: " + summary_line(res.stats or {}))

    try:
        if rank is not None:
            raise UsageError(f"{trace_file} is a graphdeck export holding its ranks (pid = rank); --rank does not "
                             "apply to it")
        with undo_new_run_on_error(engine, run_name):
            results = ingest_export(engine, trace_file, run_name=run_name, strict=strict,
                                    duplicate="replace" if replace else "refuse", on_rank=on_rank)
    except GraphdeckError as exc:
        for line in lines:  # the ranks stored before the failure stay
            click.echo(line)
        _fail(exc)
    link_kernels(engine, results[0].run_id)
    from graphdeck.analysis.traces.collectives import rank_spans

    click.echo(f"{trace_file}: a graphdeck export of {len(results)} ranks ({rank_spans([r.rank for r in results])}); "
               f"stored one trace per rank, times as exported (clock-aligned; each trace's meta "
               f"graphdeck_export names the offset applied)")
    for line in lines:
        click.echo(line)
    if as_json:
        click.echo(json.dumps({str(r.rank): r.stats for r in results}, indent=2, default=str))


def _import_debug(engine, files: list[str], run_name: str, others: bool) -> None:
    """Store the stacks of torch.distributed.debug's periodic dumps among ``files`` and print each
    rank's place (NOTE: [Debug-server dumps]); with ``others`` (other inputs given), dumps without a
    stack are named as skipped instead of failing the import."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks.live import stack_lines
    from graphdeck.analysis.ranks.records import _ranks_text
    from graphdeck.store.debug_dumps import import_debug_dumps

    try:
        dbg = import_debug_dumps(engine, files, run_name=run_name)
    except BadInputError as exc:
        if not others:
            raise
        click.echo(f"  skipped torch.distributed.debug files: {exc.message}", err=True)
        return
    click.echo(f"torch.distributed.debug stacks: ranks {_ranks_text(dbg.ranks)}, the latest of {dbg.snapshots} "
               f"periodic dump(s) ({dbg.first} to {dbg.last})"
               + "".join(f"; rank {r} did not answer: {w}" for r, w in sorted(dbg.no_answer.items())))
    with Session(engine) as s:
        for line in stack_lines(s, dbg.run_id):
            click.echo(f"  {line}")
    for x in dbg.skipped:
        click.echo(f"  skipped {x}", err=True)


@click.command("import")
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
    file names; graphdeck.store.fr_import), Kineto traces (by content) and the periodic dump folder of
    torch.distributed.debug's debug server (each rank's latest stacks; graphdeck.store.debug_dumps)
    of one job — files or directories — as run RUN."""
    from graphdeck.store.fr_import import discover, import_flight_dumps, sniff
    from graphdeck.store.torch_trace import import_torch_trace

    def open_engine(url):  # SQLAlchemy only for what is not a TORCH_TRACE log (NOTE: [SQLite store without SQLAlchemy])
        from graphdeck.store.db import open_engine

        return open_engine(url)

    try:
        found = discover(paths)
        from graphdeck.analysis.memory.snapshots import import_snapshot, is_snapshot
        from graphdeck.store.debug_dumps import dump_kind

        # torch.distributed.debug's periodic dump folder (NOTE: [Debug-server dumps])
        debug = [f for f in found if dump_kind(f)]
        found = [f for f in found if f not in debug]
        snapshots = [f for f in found if is_snapshot(f)]  # CUDA memory snapshots (NOTE: [Snapshot import])
        named = {str(Path(p)) for p in paths if not Path(p).is_dir()}  # any pickle named is read as a dump
        fr_files = [f for f in found if f not in snapshots and sniff(f, named=str(Path(f)) in named)]
        kineto = [f for f in found if f not in fr_files + snapshots and _is_kineto(f)]  # profiler traces of the same run
        logs = [p for p in paths if Path(p).is_dir() or str(Path(p)) not in {str(Path(f)) for f in fr_files + kineto
                                                                                  + snapshots + debug}]
        accounted = set(fr_files + kineto + snapshots + debug)  # a folder of these alone holds no TORCH_TRACE log
        logs = [p for p in logs if not (Path(p).is_dir() and accounted and set(discover([p])) <= accounted)]
        refused: list[str] = []  # files refused: exit 2 once the rest is kept
        if debug:
            _import_debug(open_engine(store), debug, run_name, others=bool(logs or fr_files or kineto or snapshots))
        try:
            fr = import_flight_dumps(open_engine(store), [], run_name=run_name, strict=strict, files=fr_files) \
                if fr_files else None
        except BadInputError as exc:
            if strict or not (logs or kineto or snapshots or debug) or not exc.message.startswith("no Flight Recorder dump"):
                raise
            fr, refused = None, [exc.message]
        if fr is not None:
            from graphdeck.analysis.ranks.records import _ranks_text  # ranges past 8 ranks

            click.echo(f"Flight Recorder: ranks {_ranks_text(fr.ranks)}, {fr.entries} entries, {fr.dropped} dropped"
                       + (f"; no dump from ranks {_ranks_text(fr.missing_ranks)}" if fr.missing_ranks else ""))
            for d in fr.dropped_records[:20]:
                click.echo(f"  dropped {d}", err=True)
        try:
            result = import_torch_trace(store, logs, run_name=run_name, strict=strict,
                                        progress=sys.stderr.isatty() if progress is None else progress) if logs else None
        except BadInputError as exc:
            if (fr is None and not kineto and not snapshots and not debug) or "no TORCH_TRACE log" not in exc.message:
                raise
            if exc.details.get("skipped_files") or "skipped" in exc.message:  # say what else was given
                click.echo(f"  other files: {exc.message}", err=True)
            result = None
        for f in kineto:
            from graphdeck.store.traces import ingest_trace

            t = ingest_trace(open_engine(store), f, run_name=run_name, strict=strict)
            click.echo(f"Kineto trace {Path(f).name}: rank {t.rank}, {t.num_events} events, status {t.status}")
        if kineto:
            from graphdeck.analysis.traces.mapping import link_kernels

            link_kernels(open_engine(store), t.run_id)
        refused += fr.refused if fr is not None else []
        for f in snapshots:
            try:
                m = import_snapshot(open_engine(store), f, run_name).measured
            except UsageError as exc:  # this file is refused; the others are still imported
                refused.append(exc.message)
                continue
            click.echo(f"CUDA memory snapshot {Path(f).name}: measured peak {m.peak_bytes / 2**20:,.1f} MiB, "
                       f"{m.attributed} of {m.allocations} allocations on graph nodes")
    except GraphdeckError as exc:
        if exc.details.get("stats"):
            click.echo(json.dumps(exc.details["stats"], indent=2, default=str), err=True)
        _fail(exc)
    # files refused (NOTE: [Bounded unpickling]): exit 2 naming each, after keeping everything else
    refusal = UsageError("refused " + "; ".join(refused[:20])) if refused else None
    if result is None:
        if refusal is not None:
            _fail(refusal)
        return
    st = result.stats
    from graphdeck.analysis.ranks.records import _ranks_text  # ranges past 8 ranks

    click.echo(f"run {result.run_name} (id {result.run_id}): ranks {_ranks_text(result.ranks)}; {st.get('graphs', 0)} graphs, "
               f"{st.get('nodes', 0)} nodes, {st.get('compile_events', 0)} compile events, "
               f"{st.get('kernel_nodes', 0)} kernel links; {result.dropped} dropped"
               + (f", {result.unverified} kept unverified (md5 mismatch)" if result.unverified else ""))
    if result.replaced:
        click.echo(f"  {result.replaced}", err=True)
    if st.get("output_codes") and not st.get("kernel_nodes"):
        click.echo(f"  0 kernel links: the log has Inductor output code ({st['output_codes']}) but no provenance "
                   "records that name the nodes of its (Triton) kernels; rerun with INDUCTOR_PROVENANCE=1 to link "
                   "kernels to graph nodes (C++ kernels of CPU logs link without it)", err=True)
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
    if refusal is not None:
        _fail(refusal)


@click.command("upload")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--url", required=True, help="graphdeck server, e.g. http://dash:8765.")
@click.option("--run", "run_name", required=True, help="Run to add to on the server (created if missing).")
@click.option("--rank", type=int, default=None, help="Rank, when a trace does not say.")
@click.option("--kind", type=click.Choice(["auto", "trace", "bundle"]), default="auto", show_default=True,
              help="bundle: a SQLite capture store; trace: a Kineto .json/.json.gz; auto: by the file's magic bytes.")
@click.option("--token", default=None, help="Write token (default: $GRAPHDECK_TOKEN).")
@click.option("--chunk-mb", default=8, show_default=True, help="Chunk size in MiB.")
@click.option("--strict", is_flag=True, help="Trace: fail, keeping nothing, on any dropped event.")
@click.option("--json", "as_json", is_flag=True, help="Also print the server's whole merge result (rows per table, ids).")
def upload_cmd(file: str, url: str, run_name: str, rank: int | None, kind: str, token: str | None, chunk_mb: int,
               strict: bool, as_json: bool = False) -> None:
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
               f"(id {result.get('run_id')}){again}: {upload_counts(result)}")
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))


#: The tables an upload's one line names (the rest is summed as "other rows"; --json has them all).
_UPLOAD_HEADLINE = ("ranks", "graphs", "nodes", "traces", "trace_events", "compile_events")


def upload_counts(result: dict) -> str:
    """``20 graphs, 1,766 nodes, 2 traces, 6,146 trace events, 3,100 other rows`` from a merge
    result's ``rows`` ({table: rows added}); ``nothing new`` when it added none."""
    rows = {t: n for t, n in (result.get("rows") or {}).items() if isinstance(n, int) and n}
    parts = [f"{rows.pop(t):,} {t.replace('_', ' ')}" for t in _UPLOAD_HEADLINE if t in rows]
    rest = sum(rows.values())
    if rest:
        parts.append(f"{rest:,} other rows")
    return ", ".join(parts) or "nothing new"


@click.command("delete-run")
@store_and_run(run_help="Name of the run to delete (or its id).")
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


COMMANDS = (delete_run_cmd, import_cmd, ingest_trace_cmd, upload_cmd)
