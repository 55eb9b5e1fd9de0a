"""One cost view per rank (issue 42 item 4): rank × metric in one table, for a chosen step.

# NOTE: [Rank cost view]
Each row is a rank the run knows (``0 .. world_size-1``, rank records, graphs, traces); each
column a metric, read from what the other pages read, never recomputed differently:

* ``step_time_ns`` — the step's ``ProfilerStep#N`` CPU range, else the GPU span of its kernels
  (the rank heatmap's step time, :mod:`graphdeck.analysis.ranks.heatmap`), from the trace's
  collective index (NOTE: [Collective index]);
* ``comm_count``, ``comm_bytes``, ``comm_ns`` — the step's collectives on that rank (GPU
  communication kernels, else CPU-side ones such as ``gloo:all_reduce``): how many, the bytes
  they move as nccl-tests size them (NOTE: [Bus bandwidth]; None when a collective's size is not
  in the trace) and their summed duration (waiting for peers included);
* ``peak_memory_bytes`` — the peak of the rank's newest imported CUDA memory snapshot
  (``graphdeck_memory_snapshot``, the memory page's measured peak); None without one (the memory
  page still has the graph-derived model, computed there on demand);
* ``compile_s`` — the rank's compile wall time as the compile-skew check sums it (NOTE: [Compile
  skew]: torch's ``compilation_metrics`` / ``bwd_compilation_metrics`` records, forward and lazily
  compiled backward); for a rank without those records, the summed ``compile_time_s`` of its
  graphs (a parent not counted again beside its timed DDP partitions). ``compile_source`` says
  which (``"compile records"`` | ``"graphs"``).

The step: ``step`` if given, else the step number most traced ranks have (the latest of those);
``steps`` lists every step number seen. A rank without a trace has null step and collective
cells and ``traced: false`` (missing evidence, never zero). Each cell names the page it comes
from (``links``: the rank page at that step, the trace page with its bandwidth table, the
memory page of the rank's forward graph, the run page's compile records).

Reads the stored collective index of each trace (one JSON per rank), the graphs' compile times
and the snapshot records: a 1,024-rank run is a few thousand rows.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter, OrderedDict

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.store.schema import CompileEvent, Graph, Rank, Run

METRICS = ("step_time_ns", "comm_count", "comm_bytes", "comm_ns", "peak_memory_bytes", "compile_s")
SNAPSHOT_RECORD = "graphdeck_memory_snapshot"


def _step_ns(e: dict) -> int | None:
    return e["cpu_dur_ns"] if e.get("cpu_dur_ns") is not None else e.get("gpu_span_ns")


def rank_costs(session: Session, run: Run, *, step: int | None = None, sort: str | None = None,
               descending: bool = True) -> dict:
    """The cost table of ``run`` (NOTE: [Rank cost view]).

    ``sort``: a metric of :data:`METRICS` (or ``"rank"``), rows with no value last whatever the
    order. Returns ``{"run_id", "run", "world_size", "step", "steps", "metrics", "rows": [{"rank",
    "traced", "trace_id", <metric>: value or None, "links": {metric: hash link}}], "totals":
    {metric: {"min", "max", "median", "ranks"}}, "notes"}``; times in ns, bytes in bytes,
    compile in s.

    Raises:
        BadInputError: an unknown ``sort`` metric.
    """
    from graphdeck.analysis.traces.collectives import run_traces
    from graphdeck.errors import BadInputError

    if sort is not None and sort not in METRICS and sort != "rank":
        raise BadInputError(f"unknown sort {sort!r}: one of rank, {', '.join(METRICS)}")
    traces = run_traces(session, run.id)
    known = set(traces) | set(session.scalars(select(Rank.rank).where(Rank.run_id == run.id)))
    compile_s, forward, compile_src = _compile_times(session, run.id)
    known |= set(compile_s)
    ws = max([int(run.world_size or 0)] + [r + 1 for r in known])
    per_rank = _step_sums(session, traces)
    seen: Counter = Counter()
    for sums in per_rank.values():
        seen.update({st for st in sums if st is not None})
    if step is None and seen:
        most = max(seen.values())
        step = max(s for s, n in seen.items() if n == most)
    peaks = _snapshot_peaks(session, run.id)
    rid = run.id
    rows = []
    for r in range(ws):
        row = {"rank": r, "traced": r in per_rank, "trace_id": traces.get(r), "step_time_ns": None, "comm_count": None,
               "comm_bytes": None, "comm_ns": None, "peak_memory_bytes": peaks.get(r), "compile_s": compile_s.get(r),
               "compile_source": compile_src.get(r)}
        links = {"compile_s": f"#/runs/{rid}"}
        if r in per_rank and step is not None:
            got = per_rank[r].get(step) or {"time": None, "count": 0, "ns": 0, "bytes": 0, "sized": 0}
            row["step_time_ns"] = got["time"]
            row["comm_count"], row["comm_ns"] = got["count"], got["ns"]
            row["comm_bytes"] = got["bytes"] if got["sized"] == got["count"] else None
            links["step_time_ns"] = f"#/runs/{rid}/rank/{r}?step={step}"
            links["comm_count"] = links["comm_bytes"] = links["comm_ns"] = f"#/traces/{traces[r]}"
        if r in forward:
            links["peak_memory_bytes"] = f"#/graphs/{forward[r]}/memory"
        row["links"] = links
        rows.append(row)
    if sort is not None:
        present = [x for x in rows if x[sort] is not None]
        present.sort(key=lambda x: (x[sort], x["rank"]), reverse=descending)
        rows = present + [x for x in rows if x[sort] is None]
    totals = {}
    for m in METRICS:
        vals = sorted(x[m] for x in rows if x[m] is not None)
        totals[m] = ({"min": vals[0], "max": vals[-1], "median": vals[len(vals) // 2], "ranks": len(vals)}
                     if vals else None)
    notes = []
    untraced = [x["rank"] for x in rows if not x["traced"]]
    if untraced:
        notes.append(f"{len(untraced)} rank(s) have no usable trace: no step time or collectives for them")
    if not peaks:
        notes.append("no CUDA memory snapshot imported: peak memory is unknown here (the memory page of each rank's "
                     "graph computes the graph-derived model)")
    if step is not None and per_rank and seen.get(step, 0) < len(per_rank):
        notes.append(f"step {step} is in the traces of {seen.get(step, 0)} of {len(per_rank)} traced ranks")
    return {"run_id": rid, "run": run.name, "world_size": ws, "step": step, "steps": sorted(seen),
            "metrics": list(METRICS), "rows": rows, "totals": totals, "notes": notes}


def _step_sums(session: Session, traces: dict[int, int]) -> dict[int, dict]:
    """rank → step → ``{"time", "count", "ns", "bytes", "sized"}`` from each trace's collective
    index: the step's time (:func:`_step_ns`), its collectives' count, summed ``dur_ns`` and
    ``bytes`` and how many have a size. On SQLite the sums are made by the database from the
    stored index (``json_each``: no 1,024 JSON documents parsed in Python); a trace without a
    current index, or another database, goes through
    :func:`~graphdeck.analysis.traces.collectives.trace_indexes` (read from the events if need be)."""
    from graphdeck.analysis.ranks.compile_skew import is_sqlite
    from graphdeck.analysis.traces.collectives import INDEX_KEY, INDEX_VERSION, trace_indexes

    out: dict[int, dict] = {}
    ranks = sorted(traces)
    if is_sqlite(session) and ranks:
        conn = session.connection()
        for i in range(0, len(ranks), 500):
            ids = {traces[r]: r for r in ranks[i:i + 500]}
            marks = ",".join(str(int(t)) for t in ids)
            for tid, steps in conn.exec_driver_sql(
                    f"SELECT id, json_extract(stats_json, '$.{INDEX_KEY}.steps') FROM traces WHERE id IN ({marks}) "
                    f"AND json_valid(stats_json) AND json_extract(stats_json, '$.{INDEX_KEY}.v') = {INDEX_VERSION}"):
                sums = out.setdefault(ids[tid], {})
                for e in json.loads(steps or "[]"):
                    sums[e.get("step")] = {"time": _step_ns(e), "count": 0, "ns": 0, "bytes": 0, "sized": 0}
            done = ",".join(str(traces[r]) for r in ranks[i:i + 500] if r in out) or "NULL"
            for tid, st, n, ns, nbytes, sized in conn.exec_driver_sql(
                    "SELECT t.id, json_extract(c.value, '$.step'), count(*), sum(json_extract(c.value, '$.dur_ns')), "
                    "sum(json_extract(c.value, '$.bytes')), count(json_extract(c.value, '$.bytes')) FROM traces t, "
                    f"json_each(t.stats_json, '$.{INDEX_KEY}.collectives') c WHERE t.id IN ({done}) GROUP BY t.id, 2"):
                got = out[ids[tid]].setdefault(st, {"time": None, "count": 0, "ns": 0, "bytes": 0, "sized": 0})
                got.update(count=int(n), ns=int(ns or 0), bytes=int(nbytes or 0), sized=int(sized))
    rest = {r: traces[r] for r in ranks if r not in out}
    for r, colls, steps in trace_indexes(session, rest) if rest else ():
        sums = out.setdefault(r, {})
        for e in steps:
            sums[e.get("step")] = {"time": _step_ns(e), "count": 0, "ns": 0, "bytes": 0, "sized": 0}
        for c in colls:
            got = sums.setdefault(c.get("step"), {"time": None, "count": 0, "ns": 0, "bytes": 0, "sized": 0})
            got["count"] += 1
            got["ns"] += int(c.get("dur_ns") or 0)
            if isinstance(c.get("bytes"), int):
                got["bytes"] += c["bytes"]
                got["sized"] += 1
    return out


def _compile_times(session: Session, run_id: int) -> tuple[dict[int, float], dict[int, int], dict[int, str]]:
    """rank → compile seconds (NOTE: [Rank cost view]), rank → its first ``aot_forward`` graph id
    (the memory page's graph), rank → where the seconds come from."""
    skew = _record_seconds(session, run_id)
    rows = session.execute(select(Graph.id, Graph.rank, Graph.kind, Graph.parent_id, Graph.compile_time_s)
                           .where(Graph.run_id == run_id)).all()
    timed_parents = {p for _i, _r, _k, p, t in rows if p is not None and t is not None}
    out: dict[int, float] = {}
    forward: dict[int, int] = {}
    for gid, rank, kind, _parent, t in sorted(rows):
        if t is not None and gid not in timed_parents:
            out[rank] = out.get(rank, 0.0) + float(t)
        if kind == "aot_forward" and rank not in forward:
            forward[rank] = gid
    source = {r: "graphs" for r in out} | {r: "compile records" for r in skew}
    return {**out, **skew}, forward, source


_WINDOW = 64  # characters cut out of a compile record's metadata after a field's name
_NUMBER = re.compile(r'^"\s*:\s*(null|-?[0-9.eE+-]+)\s*[,}]')


def _value(m: re.Match | None) -> float:
    if m is None or m.group(1) == "null":
        return 0.0
    try:
        return float(m.group(1))
    except ValueError:
        return 0.0


#: Compile seconds per run, kept while the run's compile records stay the same (newest id, count):
#: reading them is most of a large run's cost (~40 KB of metadata a record, 8,192 at 1,024 ranks).
_SECONDS: OrderedDict = OrderedDict()
_SECONDS_RUNS = 8
_SECONDS_LOCK = threading.Lock()


def _record_seconds(session: Session, run_id: int) -> dict[int, float]:
    """:func:`_read_record_seconds`, remembered per store and run until its compile records change."""
    from graphdeck.analysis.ranks.compile_skew import METRIC_EVENTS

    newest, count = session.execute(select(func.max(CompileEvent.id), func.count()).where(
        CompileEvent.run_id == run_id, CompileEvent.name.in_(METRIC_EVENTS))).one()
    key = (str(session.get_bind().url), run_id, newest, count)
    with _SECONDS_LOCK:
        if key in _SECONDS:
            _SECONDS.move_to_end(key)
            return _SECONDS[key]
    got = _read_record_seconds(session, run_id) if count else {}
    with _SECONDS_LOCK:
        _SECONDS[key] = got
        while len(_SECONDS) > _SECONDS_RUNS:
            _SECONDS.popitem(last=False)
    return got


def _read_record_seconds(session: Session, run_id: int) -> dict[int, float]:
    """rank → summed seconds of its torch compile records, as the compile-skew check sums them
    (:func:`graphdeck.analysis.ranks.compile_skew._parse_metrics`: ``duration_us`` / 1e6, else
    ``entire_frame_compile_time_s``). A record's metadata is ~40 KB of configs and stacks: rather
    than parse each as JSON (seconds at 1,024 ranks), the database cuts the few characters after
    each field's name; a record where that does not read as one number is parsed whole."""
    from graphdeck.analysis.ranks.compile_skew import METRIC_EVENTS, _metrics, _num, is_sqlite

    # NOTE: the cut is the only read of the metadata: its offset is found once per field

    meta = CompileEvent.metadata_json
    find = func.instr if is_sqlite(session) else func.strpos

    def cut(name: str):
        at = find(meta, f'"{name}')
        return func.substr(meta, at + len(name) + 1, _WINDOW), at

    dur, dur_at = cut("duration_us")
    whole, whole_at = cut("entire_frame_compile_time_s")
    rows = session.connection().execute(
        select(CompileEvent.id, CompileEvent.rank, CompileEvent.name, dur, dur_at, whole, whole_at)
        .where(CompileEvent.run_id == run_id, CompileEvent.name.in_(METRIC_EVENTS))).all()
    out: dict[int, float] = {}
    unread: dict[int, tuple[int, str]] = {}
    for row_id, rank, name, d_text, d_at, w_text, w_at in rows:
        d = _NUMBER.match(d_text or "") if d_at else None
        w = _NUMBER.match(w_text or "") if w_at else None
        if (d_at and d is None) or (w_at and w is None):
            unread[row_id] = (rank, name)
            continue
        secs = _value(d) / 1e6 or _value(w)
        out[rank] = out.get(rank, 0.0) + secs
    if unread:  # a field name inside a string, a null: read those records as the check does
        for row_id, text in session.execute(select(CompileEvent.id, meta).where(CompileEvent.id.in_(list(unread)))):
            rank, name = unread[row_id]
            m = _metrics(name, text)
            secs = _num(m.get("duration_us")) / 1e6 or _num(m.get("entire_frame_compile_time_s"))
            out[rank] = out.get(rank, 0.0) + secs
    return out


def _snapshot_peaks(session: Session, run_id: int) -> dict[int, int]:
    """rank → ``peak_bytes`` of its newest readable memory-snapshot record."""
    newest = (select(func.max(CompileEvent.id)).where(CompileEvent.run_id == run_id,
                                                       CompileEvent.name == SNAPSHOT_RECORD)
              .group_by(CompileEvent.rank))
    out: dict[int, int] = {}
    for rank, payload in session.execute(select(CompileEvent.rank, CompileEvent.payload)
                                         .where(CompileEvent.id.in_(newest))):
        try:
            peak = json.loads(payload or "").get("peak_bytes")
        except (ValueError, AttributeError):
            continue
        if isinstance(peak, int) and not isinstance(peak, bool):
            out[int(rank)] = peak
    return out
