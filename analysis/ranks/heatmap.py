"""Rank heatmaps (issue 26 item 2): one matrix of ranks × steps or ranks × collectives, for the
pages that would otherwise list a row, a lane or a table per rank.

# NOTE: [Rank heatmap]
Source: :func:`graphdeck.analysis.traces.collectives.align_and_match` over the run's usable traces
(the newest ``ok`` / ``truncated`` trace per rank), the same matching, clock offsets, step times and
stragglers as the run timeline, ``check-ranks`` and the overview. Metrics (every time in ns):

* ``step_time`` (axis ``steps`` only): the ``ProfilerStep#N`` CPU range, else the GPU span of the
  step's kernels (:func:`~graphdeck.analysis.traces.analyze.step_times`).
* ``lateness``: per collective, the rank's aligned arrival − the first rank's arrival; per step, its
  sum over the step's matched collectives (the stragglers' ``lateness_ns``).
* ``wait``: per collective, the time the rank's kernel waited for the last peer (``wait_ns``); per
  step, its sum. Per step, suspect matches (not one collective, or clocks off) are left out, as the
  stragglers leave them out; per collective they are shown, the column flagged ``suspect``.
* ``finding`` (categorical, :data:`FINDINGS`): ``ok``; ``late`` (arrived last at the collective,
  or the step's straggler); ``suspect`` (the match is suspect); ``diverged`` (the rank's collective
  at this match is another op, or moves another element count, than most ranks': the matching's
  ``divergent`` list, or AllReduce where the others run ReduceScatter);
  ``absent`` (the rank has a trace but no entry here while other ranks have one: a skipped
  collective or a missing step, what a hang looks like).

Rows are every rank the run knows (``0 .. world_size-1``, rank records, graphs, traces), ascending.
A rank without a usable trace is ``no_trace`` in ``row_state`` and its cells are null: missing
evidence, never a healthy colour. A null cell of a traced row means "no value here" (not in this
collective, no such step). More collectives than ``max_columns`` are binned: consecutive
collectives share a column, the worst value of the bin kept (the largest time, the most severe
finding), and the column says which collectives it holds.

More ranks than ``max_rows`` (:data:`MAX_ROWS`; a canvas row per rank stops fitting a page, and
a canvas past ~32k px stops drawing) are binned the same way: consecutive ranks share a row, each
cell the worst of the bin's traced ranks; the row says which ranks it holds (``ranks`` its first,
``rank_last``), which of them is the worst (``rank_worst``: the largest sum over the row, or the
worst finding; the drill-down opens it) and how many of them have no trace (``row_no_trace``): a
bin with some untraced ranks is ``partial`` in ``row_state`` — missing evidence stays visible.

The matched result is cached per store, run and set of traces (a few runs, :data:`CACHE_RUNS`), so
the heatmap's metrics and the overview's slowest steps share one matching of a large run;
concurrent first requests compute it once.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import OrderedDict

from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.errors import BadInputError
from graphdeck.store.schema import Graph, Rank, Run, Trace

METRICS = ("step_time", "lateness", "wait", "finding")
AXES = ("steps", "collectives")
#: Finding codes in the ``finding`` matrix; a larger code is worse (a binned column keeps the largest).
FINDINGS = (
    {"code": 0, "key": "ok", "label": "took part, nothing found"},
    {"code": 1, "key": "late", "label": "arrived last / the step's straggler"},
    {"code": 2, "key": "suspect", "label": "suspect match (not one collective, or clocks off)"},
    {"code": 3, "key": "diverged", "label": "another op or element count than most ranks at this collective"},
    {"code": 4, "key": "absent", "label": "traced, but no entry here while other ranks have one"},
)
_CODE = {f["key"]: f["code"] for f in FINDINGS}
MAX_COLUMNS = 256
#: More ranks than this share rows (NOTE: [Rank heatmap]); 1,024 ranks are drawn a row each.
MAX_ROWS = 2048
#: Divergent ranks listed with the matrix (the first by rank; the cells mark them all).
DIVERGENT_LISTED = 64
#: Runs whose matched traces are kept in memory (per process).
CACHE_RUNS = 2
#: A run's world size above this is not expanded into rows (a bogus value must not make 2**31 rows).
MAX_WORLD_ROWS = 65_536

_cache: OrderedDict = OrderedDict()
_lock = threading.Lock()
_computing: dict[tuple, threading.Lock] = {}


def _usable(session: Session, run_id: int) -> dict[int, Trace]:
    rows = session.scalars(select(Trace).where(Trace.run_id == run_id, Trace.status.in_(("ok", "truncated")))
                           .order_by(Trace.id)).all()
    return {t.rank: t for t in rows}  # the newest per rank wins, as run_traces does


def matched_run(session: Session, run_id: int) -> tuple[dict[int, int], dict | None]:
    """(rank → trace id of the newest usable trace, :func:`align_and_match`'s result or None
    without traces). Cached per store URL, run and traces (id, event count, end): a trace added,
    replaced or deleted is a new key. Raises NotFoundError for an unknown run."""
    from graphdeck.analysis.traces.collectives import align_and_match

    usable = _usable(session, run_id)
    traces = {r: t.id for r, t in sorted(usable.items())}
    if not traces:
        return traces, None
    key = (str(session.get_bind().url), run_id,
           tuple((r, t.id, t.num_events, t.end_ns) for r, t in sorted(usable.items())))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return traces, hit
        gate = _computing.setdefault(key, threading.Lock())
    with gate:  # the heatmap and the overview's slowest steps ask at once on a cold page: match once
        try:
            with _lock:
                hit = _cache.get(key)
            if hit is not None:
                return traces, hit
            result = align_and_match(session, run_id, None, dict(traces))
            with _lock:
                _cache[key] = result
                while len(_cache) > CACHE_RUNS:
                    _cache.popitem(last=False)
        finally:
            with _lock:
                if _computing.get(key) is gate:
                    del _computing[key]
    return traces, result


def run_ranks(session: Session, run: Run) -> list[int]:
    """Every rank the run knows: ``0 .. world_size-1`` (up to :data:`MAX_WORLD_ROWS`), rank
    records, graphs and traces; ascending."""
    ranks = set(session.scalars(select(Rank.rank).where(Rank.run_id == run.id)))
    ranks |= set(session.scalars(select(Graph.rank).where(Graph.run_id == run.id).distinct()))
    ranks |= set(session.scalars(select(Trace.rank).where(Trace.run_id == run.id).distinct()))
    if run.world_size and 0 < run.world_size <= MAX_WORLD_ROWS:
        ranks |= set(range(run.world_size))
    return sorted(r for r in ranks if r is not None)


def _step_dur(e: dict) -> int | None:
    return e["cpu_dur_ns"] if e.get("cpu_dur_ns") is not None else e.get("gpu_span_ns")


def _step_key(step) -> tuple:
    return (step is None, step or 0)


def _op(kernel: str | None, fallback: str) -> str:
    from graphdeck.analysis.traces.collectives import _kind

    return _kind(kernel, {}) if kernel else fallback


def _columns_steps(matched: dict, metric: str, ranks: list[int]) -> tuple[list[dict], dict[int, list]]:
    steps_by_rank = matched["step_times"]
    lateness = {s["step"]: s for s in matched["stragglers"]}
    wait_by: dict = {}
    for c in matched["collectives"]:
        if c["suspect"]:
            continue
        for r, v in c["ranks"].items():
            wait_by.setdefault(c["step"], {}).setdefault(r, 0)
            wait_by[c["step"]][r] += v["wait_ns"]
    diverged = {(d["rank"], d.get("step")) for d in matched.get("divergent") or []}
    steps = sorted({e["step"] for es in steps_by_rank.values() for e in es} | set(lateness), key=_step_key)
    cols = [{"label": f"step {s}" if s is not None else "outside steps", "step": s} for s in steps]
    rows: dict[int, list] = {}
    for r in ranks:
        if r not in steps_by_rank:
            continue
        mine = {e["step"]: e for e in steps_by_rank[r]}
        row = []
        for s in steps:
            late = lateness.get(s)
            if metric == "step_time":
                row.append(_step_dur(mine[s]) if s in mine else None)
            elif metric == "lateness":
                row.append(late["lateness_ns"].get(r) if late else None)
            elif metric == "wait":
                row.append(wait_by.get(s, {}).get(r))
            else:
                took_part = s in mine or (late is not None and r in late["lateness_ns"])
                row.append(_CODE["absent"] if not took_part else _CODE["diverged"] if (r, s) in diverged
                           else _CODE["late"] if late is not None and late["straggler"] == r else _CODE["ok"])
        rows[r] = row
    return cols, rows


def _columns_collectives(matched: dict, metric: str, ranks: list[int]) -> tuple[list[dict], dict[int, list]]:
    colls = matched["collectives"]
    traced = set(matched["step_times"])
    cols, by_rank = [], {r: [] for r in ranks if r in traced}
    diverged = {(d["rank"], str(d["group"]), d["seq"]) for d in matched.get("divergent") or []}
    for i, c in enumerate(colls):
        parts = c["ranks"]
        ops = {r: _op(v.get("kernel"), c["kind"]) for r, v in parts.items()}
        common = max(sorted(set(ops.values())), key=lambda k: sum(1 for o in ops.values() if o == k)) if ops else None
        first = min(v["arrive_ns"] for v in parts.values())
        cols.append({"label": f"{c['kind']} {c['group']} #{c['seq']}", "index": i, "group": c["group"],
                     "kind": c["kind"], "seq": c["seq"], "step": c["step"], "suspect": bool(c["suspect"])})
        for r, row in by_rank.items():
            v = parts.get(r)
            if metric == "lateness":
                row.append(v["arrive_ns"] - first if v else None)
            elif metric == "wait":
                row.append(v["wait_ns"] if v else None)
            elif v is None:
                row.append(_CODE["absent"])
            elif ops[r] != common or (r, str(c["group"]), c["seq"]) in diverged:
                row.append(_CODE["diverged"])
            elif c["suspect"]:
                row.append(_CODE["suspect"])
            else:
                row.append(_CODE["late"] if c["last_rank"] == r else _CODE["ok"])
    return cols, by_rank


def _bin(cols: list[dict], rows: dict[int, list], max_columns: int) -> tuple[list[dict], dict[int, list], int]:
    """Consecutive columns merged so at most ``max_columns`` remain; each keeps its bin's maximum."""
    n = len(cols)
    if n <= max_columns:
        return cols, rows, 1
    size = math.ceil(n / max_columns)
    out_cols = []
    for a in range(0, n, size):
        part = cols[a:a + size]
        steps = sorted({c.get("step") for c in part} - {None})
        out_cols.append({"label": f"collectives {part[0]['index']}–{part[-1]['index']} ({len(part)})",
                         "index": part[0]["index"], "last_index": part[-1]["index"], "count": len(part),
                         "step": steps[0] if len(steps) == 1 else None, "steps": steps,
                         "suspect": any(c.get("suspect") for c in part)})
    out_rows = {}
    for r, row in rows.items():
        merged = []
        for a in range(0, n, size):
            vals = [v for v in row[a:a + size] if v is not None]
            merged.append(max(vals) if vals else None)
        out_rows[r] = merged
    return out_cols, out_rows, size


def _bin_rows(out: dict, max_rows: int) -> None:
    """Consecutive ranks of ``out`` (a heatmap document) merged so at most ``max_rows`` rows
    remain; each cell keeps its bin's worst value (the largest), the row its worst rank."""
    ranks, n = out["ranks"], len(out["ranks"])
    if n <= max_rows:
        return
    size = math.ceil(n / max_rows)
    traces = dict(zip(ranks, out["trace_ids"]))
    values, state = out["values"], out["row_state"]
    rows, firsts, lasts, worst, missing, tids, states = [], [], [], [], [], [], []
    for a in range(0, n, size):
        idx = range(a, min(n, a + size))
        traced = [i for i in idx if state[i] != "no_trace"]
        width = len(values[a]) if values else 0
        row = []
        for c in range(width):
            vals = [values[i][c] for i in traced if values[i][c] is not None]
            row.append(max(vals) if vals else None)
        rows.append(row)
        pick = max(traced, key=lambda i: (sum(v for v in values[i] if v is not None), -i), default=None)
        worst.append(ranks[pick] if pick is not None else ranks[a])
        tids.append(traces[ranks[pick]] if pick is not None else None)
        firsts.append(ranks[a])
        lasts.append(ranks[idx[-1]])
        missing.append(len(idx) - len(traced))
        states.append("no_trace" if not traced else "partial" if missing[-1] else "trace")
    out.update(values=rows, ranks=firsts, rank_last=lasts, rank_worst=worst, trace_ids=tids,
               row_no_trace=missing, binned_rows=size, row_state=states)


#: Lanes the run timeline draws by default (the worst ranks); more are asked for by ``ranks=``.
TIMELINE_LANES = 8


def timeline_lanes(matched: dict | None, traced: list[int], spec: str | None,
                   limit: int = TIMELINE_LANES) -> tuple[list[int], str]:
    """The ranks the run timeline draws a lane for, and why: ``spec`` (``"0,2-5"``, ``"all"``) →
    those (``"requested"``); else every traced rank when there are at most ``limit``
    (``"all"``); else the ``limit`` worst: the most late first (each rank's lateness summed over
    the steps of ``matched``'s stragglers, so the straggler leads), then the reference (lowest)
    rank for comparison (``"worst"``), in that order (the timeline draws its lanes so, top to
    bottom). ``traced``: the ranks with a usable trace.

    Raises:
        UsageError: a bad ``spec`` or ranks without a usable trace (HTTP 400; the message names them).
    """
    from graphdeck.analysis.traces.export import parse_ranks

    if spec is not None and spec.strip():
        return parse_ranks(spec, traced), "requested" if spec.strip().lower() != "all" else "all"
    ranks = sorted(traced)
    if len(ranks) <= limit:
        return ranks, "all"
    late: dict[int, int] = {}
    for s in (matched or {}).get("stragglers") or []:
        for r, ns in (s.get("lateness_ns") or {}).items():
            late[int(r)] = late.get(int(r), 0) + int(ns or 0)
    worst = sorted((r for r in ranks if r in late), key=lambda r: (-late[r], r))[:limit - 1]
    for r in ranks:  # the reference rank, then the lowest ones, fill what lateness did not
        if len(worst) >= limit:
            break
        if r not in worst:
            worst.append(r)
    return worst, "worst"  # in this order, the straggler first (docs/large-runs.md), not by rank


def check_heatmap_args(metric: str, axis: str, max_columns: int = MAX_COLUMNS, max_rows: int = MAX_ROWS) -> None:
    """Raises BadInputError (HTTP 400) for an unknown metric or axis, ``step_time`` per
    collective, or ``max_columns`` / ``max_rows`` < 1."""
    if metric not in METRICS:
        raise BadInputError(f"unknown metric {metric!r}: use one of {', '.join(METRICS)}")
    if axis not in AXES:
        raise BadInputError(f"unknown axis {axis!r}: use one of {', '.join(AXES)}")
    if metric == "step_time" and axis != "steps":
        raise BadInputError("step_time is measured per step: use axis=steps")
    if max_columns < 1:
        raise BadInputError(f"max_columns must be at least 1, got {max_columns}")
    if max_rows < 1:
        raise BadInputError(f"max_rows must be at least 1, got {max_rows}")


def _quantile(values: list[int], q: float) -> int | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def rank_heatmap(session: Session, run: Run, metric: str = "step_time", axis: str = "steps",
                 max_columns: int = MAX_COLUMNS, max_rows: int = MAX_ROWS) -> dict:
    """The rank heatmap of ``run`` (NOTE: [Rank heatmap]).

    Returns ``{"run_id", "run", "metric", "axis", "unit": "ns" | "finding", "ranks": [int]
    (rows, ascending), "row_state": ["trace" | "no_trace"] per row, "trace_ids": [int | None]
    per row, "columns": [{"label", "step", ...}] (collectives: ``index``, ``group``, ``kind``,
    ``seq``, ``suspect``; binned: ``last_index``, ``count``, ``steps``), "values": [[int | None]]
    (one list per row, one value per column: ns, or a finding code), "findings": FINDINGS,
    "scale": {"min", "max", "p99", "median"} (ns, None for findings or no value), "binned": collectives
    per column, "straggler": rank | None, "straggler_message", "divergent": the matching's divergent
    ranks (``rank``, ``group``, ``seq``, ``step``, ``kind``, ``nelems``, ``expected_*``; the first
    :data:`DIVERGENT_LISTED`), "counts": {"ranks", "traced",
    "no_trace"}, "reason": why the matrix is empty (None otherwise), "elapsed_s"}``. More ranks
    than ``max_rows``: rows are bins of ``binned_rows`` ranks (``ranks`` the first of each,
    ``rank_last``, ``rank_worst``, ``row_no_trace``; ``row_state`` ``partial`` for a bin with
    some ranks untraced; ``trace_ids`` the worst rank's).

    Raises:
        BadInputError: an unknown metric or axis, ``step_time`` per collective, or
            ``max_columns`` / ``max_rows`` < 1 (HTTP 400).
    """
    check_heatmap_args(metric, axis, max_columns, max_rows)
    t0 = time.perf_counter()
    ranks = run_ranks(session, run)
    traces, matched = matched_run(session, run.id)
    out = {"run_id": run.id, "run": run.name, "metric": metric, "axis": axis,
           "unit": "finding" if metric == "finding" else "ns", "ranks": ranks,
           "row_state": ["trace" if r in traces else "no_trace" for r in ranks],
           "trace_ids": [traces.get(r) for r in ranks], "columns": [], "values": [[] for _ in ranks],
           "findings": list(FINDINGS), "scale": {"min": None, "max": None, "p99": None}, "binned": 1,
           "straggler": None, "straggler_message": None, "divergent": [], "reason": None,
           "counts": {"ranks": len(ranks), "traced": len(traces), "no_trace": len(ranks) - len(traces)}}
    if matched is None:
        out["reason"] = "no usable trace in this run: nothing is measured per rank (ingest each rank's trace)"
    else:
        timing = matched.get("timing") or {}
        out["straggler"], out["straggler_message"] = timing.get("straggler"), timing.get("message")
        out["divergent"] = [{k: d.get(k) for k in ("rank", "group", "seq", "step", "kind", "nelems", "expected_kind",
                                                   "expected_nelems", "agreeing_ranks", "count", "expected_count")}
                            for d in (matched.get("divergent") or [])[:DIVERGENT_LISTED]]
        if axis == "steps":
            cols, rows = _columns_steps(matched, metric, ranks)
        else:
            cols, rows = _columns_collectives(matched, metric, ranks)
            cols, rows, out["binned"] = _bin(cols, rows, max_columns)
        out["columns"] = cols
        out["values"] = [rows.get(r) or [None] * len(cols) for r in ranks]
        if not cols:
            out["reason"] = ("no collective matched across ranks" if axis == "collectives"
                             else "the traces have no timed step")
        if metric != "finding":
            flat = [v for row in rows.values() for v in row if v is not None]
            if flat:
                out["scale"] = {"min": min(flat), "max": max(flat), "p99": _quantile(flat, 0.99),
                                "median": int(statistics.median(flat))}
    out["binned_rows"] = 1
    _bin_rows(out, max_rows)
    out["elapsed_s"] = round(time.perf_counter() - t0, 3)
    return out
