"""Trace views beyond one file: windowed (level-of-detail) timelines, the multi-rank timeline,
per-trace analyses, collectives across ranks, and replay frames.

* ``GET /api/traces/{trace_id}/window?t0_ms=&t1_ms=&max_shapes=2000``: the timeline of a time
  window (ms since the trace's first event; default the whole trace) with at most
  ``max_shapes`` bars, the longest when more overlap it (NOTE: [Timeline level of detail]).
* ``GET /api/runs/{run_id}/timeline?t0_ms=&t1_ms=&max_shapes=3000``: every rank's newest trace on
  one time axis, clocks aligned (NOTE: [Rank clock alignment]), lanes per CPU thread and GPU
  stream, ranks stacked; ``layout.meta.offsets`` gives each rank's estimated offset.
* ``GET /api/traces/{trace_id}/bandwidth?link_gbps=``: each collective's algbw / busbw (NOTE: [Bus bandwidth]).
* ``GET /api/traces/{trace_id}/analysis?comm=REGEX``: step times, GPU busy/idle, hotspots,
  comm/compute overlap, kernel → node coverage (``comm`` adds communication-kernel patterns).
* ``GET /api/runs/{run_id}/collectives?comm=REGEX``: collectives matched across ranks, offsets,
  stragglers.
* ``GET /api/traces/{trace_id}/replay?step=&highlight=``: the frames of a replay (GPU kernels, or
  a CPU trace's compiled-region ops and C++ kernels), with how each highlight matched.
* ``GET /api/graphs/{graph_id}/node-times?trace_id=``: GPU ns per FX node of the graph.

Times in answers are ns as decimal strings where they are absolute (past 2**53), ms floats
where relative.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy.orm import Session

from graphdeck.analysis.graphs.view import loads_json
from graphdeck.analysis.traces.analyze import analyze_trace
from graphdeck.analysis.traces.collectives import align_and_match, run_traces
from graphdeck.analysis.traces.mapping import node_time_ns
from graphdeck.analysis.traces.window import IndexCache, fetch_rows
from graphdeck.errors import NotFoundError, UsageError
from graphdeck.replay.frames import replay_frames
from graphdeck.server.deps import get_session, get_settings, resolve_graph, resolve_run
from graphdeck.server.render.timeline import rank_pid, timeline_figure
from graphdeck.server.routes.export import comm_rule
from graphdeck.server.routes.traces import resolve_trace
from graphdeck.server.settings import Settings
from graphdeck.store.schema import Graph, Run, Trace

router = APIRouter(tags=["traces"])

MAX_SHAPES_LIMIT = 5000

#: The widest window edge, ms either side of a trace's start (about 31 years): ns stay far inside
#: int64 however a trace's clock is based. ``nan``, ``inf`` or ``1e308`` answer 422 naming the
#: parameter (``query.t0_ms: ...``), never an ``OverflowError`` (a 500).
MAX_WINDOW_MS = 1e12


def _ms_query(description: str):
    return Query(None, allow_inf_nan=False, ge=-MAX_WINDOW_MS, le=MAX_WINDOW_MS, description=description)


def _cache(request: Request) -> IndexCache:
    cache = getattr(request.app.state, "trace_index_cache", None)
    if cache is None:
        cache = request.app.state.trace_index_cache = IndexCache()
    return cache


def _window(idx, origin_ns: int, t0_ms: float | None, t1_ms: float | None) -> tuple[int, int]:
    span = idx.span or (origin_ns, origin_ns)
    t0 = origin_ns + round(t0_ms * 1e6) if t0_ms is not None else span[0]
    t1 = origin_ns + round(t1_ms * 1e6) if t1_ms is not None else span[1] + 1
    if t1 <= t0:
        raise UsageError(f"empty window: t1_ms ({t1_ms}) must be after t0_ms ({t0_ms})")
    return t0, t1


@router.get("/api/traces/{trace_id}/window")
def get_window(request: Request, t0_ms: float | None = _ms_query("window start, ms since the trace start"),
               t1_ms: float | None = _ms_query("window end, ms since the trace start"),
               max_shapes: int = Query(2000, ge=1, le=MAX_SHAPES_LIMIT, description="most bars drawn"),
               trace: Trace = Depends(resolve_trace), session: Session = Depends(get_session)) -> dict:
    """A window of one trace's timeline at a level of detail that keeps at most ``max_shapes`` bars."""
    idx = _cache(request).get(session, trace.id)
    origin = trace.start_ns if trace.start_ns is not None else (idx.span or (0, 0))[0]
    t0, t1 = _window(idx, origin, t0_ms, t1_ms)
    ids, total = idx.select(t0, t1, max_shapes)
    meta = loads_json(trace.meta_json, {})
    fig = timeline_figure(fetch_rows(session, ids), start_ns=origin, title=f"{trace.name} (rank {trace.rank})",
                          total_events=total, process_labels=meta.get("process_labels") or {},
                          thread_names=meta.get("thread_names") or {})
    fig["layout"]["meta"].update(window_ms=[round((t0 - origin) / 1e6, 6), round((t1 - origin) / 1e6, 6)],
                                 in_window=total, max_shapes=max_shapes, start_ns=str(origin))
    fig["layout"]["xaxis"]["range"] = fig["layout"]["meta"]["window_ms"]
    return fig


@router.get("/api/runs/{run_id}/timeline")
def get_run_timeline(request: Request, t0_ms: float | None = _ms_query("ms since the run's aligned start"),
                     t1_ms: float | None = _ms_query("ms since the run's aligned start"),
                     max_shapes: int = Query(3000, ge=1, le=MAX_SHAPES_LIMIT, description="most bars drawn, all ranks"),
                     comm: list[str] | None = Query(None, description="extra communication-kernel patterns"),
                     ranks: str | None = Query(None, description="lanes: all, or ranks and ranges (0,2-5); "
                                               "default: all up to 8 traced ranks, else the 8 worst"),
                     run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """Ranks of a run on one aligned time axis (rank-major lanes), at most ``max_shapes`` bars.
    Lanes: ``ranks``, or past 8 traced ranks the worst 8 (the most late first, the straggler
    leading; :func:`graphdeck.analysis.ranks.heatmap.timeline_lanes`); ``layout.meta.lanes`` says
    which (``shown``, ``traced``, ``chosen``: requested | all | worst). 400 for a bad ``ranks``."""
    from graphdeck.analysis.ranks.heatmap import matched_run, timeline_lanes

    traces = run_traces(session, run.id)
    if not traces:
        raise NotFoundError(f"run {run.name!r} has no trace", resource="trace", id=run.name)
    if len(traces) > 1:  # the default rule: the matching the heatmap and overview share (cached)
        aligned = align_and_match(session, run.id, comm_rule(comm), traces) if comm else matched_run(session, run.id)[1]
    else:
        aligned = None
    lanes, chosen = timeline_lanes(aligned, list(traces), ranks)
    offsets = {r: (aligned["offsets"][r]["offset_ns"] if aligned else 0) for r in traces}
    cache = _cache(request)
    idxs = {r: cache.get(session, traces[r]) for r in lanes}
    spans = {r: i.span for r, i in idxs.items() if i.span}
    if not spans:
        raise NotFoundError(f"run {run.name!r} has no timed events", resource="trace", id=run.name)
    origin = min(s[0] - offsets[r] for r, s in spans.items())
    end = max(s[1] - offsets[r] for r, s in spans.items())
    t0 = origin + round(t0_ms * 1e6) if t0_ms is not None else origin
    t1 = origin + round(t1_ms * 1e6) if t1_ms is not None else end + 1
    if t1 <= t0:
        raise UsageError(f"empty window: t1_ms ({t1_ms}) must be after t0_ms ({t0_ms})")
    budget = max(1, max_shapes // len(idxs))
    events, total, labels, threads = [], 0, {}, {}
    for r, idx in sorted(idxs.items()):
        off = offsets[r]
        ids, n = idx.select(t0 + off, t1 + off, budget)
        total += n
        trace = session.get(Trace, traces[r])
        meta = loads_json(trace.meta_json, {})
        for pid, label in (meta.get("process_labels") or {}).items():
            labels[rank_pid(r, pid)] = label
        for key, name in (meta.get("thread_names") or {}).items():
            threads[f"r{r}:{key}"] = name
        for row in fetch_rows(session, ids):
            row["ts_ns"] -= off
            row["pid"] = rank_pid(r, row["pid"])
            events.append(row)
    title = (f"run {run.name}: {len(idxs)} ranks, clocks aligned" if chosen == "all"
             else f"run {run.name}: {len(idxs)} of {len(traces)} traced ranks, clocks aligned")
    fig = timeline_figure(events, start_ns=origin, title=title,
                          total_events=total, process_labels=labels, thread_names=threads, rank_order=lanes)
    fig["layout"]["meta"].update(
        window_ms=[round((t0 - origin) / 1e6, 6), round((t1 - origin) / 1e6, 6)], in_window=total,
        max_shapes=max_shapes, start_ns=str(origin),
        offsets={str(r): {"offset_ns": offsets[r], **({k: v for k, v in aligned["offsets"][r].items() if k != "offset_ns"}
                                                       if aligned else {"method": "single rank"})} for r in traces},
        traces={str(r): t for r, t in traces.items()},
        lanes={"shown": lanes, "traced": len(traces), "chosen": chosen})
    fig["layout"]["xaxis"]["range"] = fig["layout"]["meta"]["window_ms"]
    return fig


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        return str(value)
    return value


@router.get("/api/traces/{trace_id}/analysis")
def get_analysis(comm: list[str] | None = Query(None, description="extra communication-kernel patterns (regex)"),
                 top: int = Query(10, ge=1, le=200), trace: Trace = Depends(resolve_trace),
                 session: Session = Depends(get_session)) -> dict:
    """Step times, GPU busy/idle, scheduling-delay hotspots, comm/compute overlap and kernel →
    node coverage of one trace (``graphdeck.analysis.traces.analyze.analyze_trace``)."""
    return _jsonable(analyze_trace(session, trace.id, comm_rule(comm), top))


@router.get("/api/runs/{run_id}/idle")
def get_idle(kernel_wait_us: float = Query(30.0, gt=0, le=1e6, description="HTA's consecutive_kernel_delay: a shorter "
                                           "gap between already-queued kernels is kernel wait (µs)"),
             run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """Idle time by cause per rank and step (NOTE: [Idle time by cause]): GPU stream idle as host
    wait / kernel wait / other (HTA's rule), and each step's host time by cause (compiled, data
    loader, collectives, optimizer, eager ops, Python); times in int ns
    (``graphdeck.analysis.traces.idle.idle_by_cause``)."""
    from graphdeck.analysis.traces.idle import idle_by_cause

    return _jsonable(idle_by_cause(session, run.id, round(kernel_wait_us * 1000)))


@router.get("/api/runs/{run_id}/collectives")
def get_collectives(comm: list[str] | None = Query(None, description="extra communication-kernel patterns (regex)"),
                    run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """Collectives matched across the run's ranks, per-rank clock offsets, stragglers per step.
    ``verdict`` is check-ranks' (:func:`graphdeck.analysis.ranks.core.rank_report`: OK, FAIL or
    INCOMPLETE; NOTE: [One rank verdict]); ``divergent`` lists where the traces' collectives differ
    — evidence that verdict weighs, not a second one (``trace_verdict``: the matching's own)."""
    from graphdeck.analysis.ranks.core import rank_report

    doc = align_and_match(session, run.id, comm_rule(comm))
    doc["trace_verdict"], doc["verdict"] = doc["verdict"], rank_report(session, run).verdict
    return _jsonable(doc)


@router.get("/api/traces/{trace_id}/bandwidth")
def get_bandwidth(comm: list[str] | None = Query(None, description="extra communication-kernel patterns (regex)"),
                  link_gbps: float | None = Query(None, gt=0, le=1e6, allow_inf_nan=False, description="the link's peak, GB/s (default: the "
                                                  "server's --link-gbps / GRAPHDECK_LINK_GBPS, else none)"),
                  trace: Trace = Depends(resolve_trace), session: Session = Depends(get_session),
                  settings: Settings = Depends(get_settings)) -> dict:
    """Each collective's algorithm and bus bandwidth (GB/s) by nccl-tests' formulas per collective
    type, its share of the link's peak, and the slowest collective per group and step
    (:func:`graphdeck.analysis.traces.bandwidth.collective_bandwidth`, NOTE: [Bus bandwidth])."""
    import json

    from graphdeck.analysis.traces.analyze import TraceData
    from graphdeck.analysis.traces.bandwidth import collective_bandwidth

    try:
        meta = json.loads(trace.meta_json or "{}")
    except ValueError:
        meta = {}
    peak = link_gbps if link_gbps is not None else settings.link_gbps
    doc = collective_bandwidth(TraceData(session, trace.id), meta if isinstance(meta, dict) else {},
                               rule=comm_rule(comm), link_gbps=peak)
    return {"trace_id": trace.id, "rank": trace.rank, **_jsonable(doc)}


@router.get("/api/traces/{trace_id}/replay")
def get_replay(step: int | None = Query(None, description="ProfilerStep number (default: the first)"),
               highlight: list[str] | None = Query(None, description="op families (matmul), op / kernel / node names or regexes"),
               trace: Trace = Depends(resolve_trace), session: Session = Depends(get_session)) -> dict:
    """The frames of a replay: the step's kernels (in a CPU trace, the ops and C++ kernels of its
    compiled regions) in time order with their graph nodes; ``highlights`` says how each
    highlight matched and ``warnings`` names the ones that matched nothing."""
    return replay_frames(session, trace.id, step=step, highlight_ops=highlight).as_dict()


@router.get("/api/graphs/{graph_id}/node-times")
def get_node_times(trace_id: int | None = Query(None, description="default: the newest trace of the graph's rank"),
                   graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """Kernel ns per FX node name (GPU kernels, or a CPU trace's ops and C++ kernels with their
    dispatch; ``graphdeck.analysis.traces.mapping.node_time_ns``)."""
    return {"graph_id": graph.id, "trace_id": trace_id, "node_ns": node_time_ns(session, graph.id, trace_id)}
