"""Run routes: the list of runs, one run with its ranks, graphs, traces and DDP partitions, and
deleting a run (``DELETE /api/runs/{run_id}``: a write, so it needs a write token when the server
has write tokens, see :mod:`graphdeck.server.auth`).

A run whose name holds ``/`` is reached with the name URL-encoded (NOTE: [Run names with '/'] in
:mod:`graphdeck.server.deps`). When the app starts, traces whose ingest died are swept in the
background (NOTE: [Stale ingests] in :mod:`graphdeck.store.db`).
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from graphdeck.server.deps import RunPathRoute, find_run, get_engine, get_session, rank_query, resolve_run
from graphdeck.store.schema import Graph, Partition, Rank, Run, Trace

log = logging.getLogger(__name__)


#: Seconds between two sweeps of dead writers' traces on reads of the runs (NOTE: [Writer stamps]).
DEAD_SWEEP_EVERY_S = 5.0


def sweep_dead(request: Request) -> None:
    """Dependency of the run reads: traces left ``ingesting`` by a writer known dead (it ran on this
    host and is gone) are removed before the answer, at most every :data:`DEAD_SWEEP_EVERY_S`;
    no-op on a server without a write engine."""
    import time

    from graphdeck.store.db import sweep_dead_ingests

    state, now = request.app.state, time.monotonic()
    engine = getattr(state, "engine", None)
    if engine is None or now - getattr(state, "dead_sweep_at", -1e9) < DEAD_SWEEP_EVERY_S:
        return
    state.dead_sweep_at = now
    try:
        swept = sweep_dead_ingests(engine)
        if swept:
            log.warning("removed %d trace(s) whose writer was killed: ids %s", len(swept), swept)
    except Exception:  # noqa: BLE001 - a sweep that fails leaves the rows hidden, as before
        log.exception("sweeping dead writers' traces failed")


def _sweep(engine) -> None:
    from graphdeck.store.db import sweep_dead_ingests, sweep_stale_traces

    try:
        swept = sweep_dead_ingests(engine) + sweep_stale_traces(engine)
        if swept:
            log.warning("removed %d trace(s) whose ingest died: ids %s", len(swept), swept)
    except Exception:  # noqa: BLE001 - a sweep that fails leaves the rows hidden, as before
        log.exception("sweeping stale trace ingests failed")


@asynccontextmanager
async def _lifespan(app):
    """At start: sweep traces left ``ingesting`` by a dead writer, on a thread (it waits out a probe);
    prepare the newest large runs' first picture on another (:func:`graphdeck.server.routes.heatmap.warm_up`)."""
    engine = getattr(app.state, "engine", None)
    if engine is not None:
        app.state.stale_sweep = threading.Thread(target=_sweep, args=(engine,), name="graphdeck-sweep", daemon=True)
        app.state.stale_sweep.start()
    if getattr(app.state, "read_engine", None) is not None:
        from graphdeck.server.routes.heatmap import warm_up

        app.state.warm_up = threading.Thread(target=warm_up, args=(app,), name="graphdeck-warm", daemon=True)
        app.state.warm_up.start()
    yield


router = APIRouter(tags=["runs"], route_class=RunPathRoute, lifespan=_lifespan)

GRAPH_FIELDS = ("id", "rank", "ordinal", "kind", "name", "compile_id", "frame_name", "num_nodes", "parent_id",
                "partition_index", "compile_time_s", "break_reason", "structural_hash", "backend")
RANK_FIELDS = ("rank", "world_size", "hostname", "pid", "backend", "torch_version")
TRACE_FIELDS = ("id", "rank", "name", "status", "num_events", "start_ns", "end_ns")


def pick(row, fields) -> dict:
    return {f: getattr(row, f) for f in fields}


def _count(session: Session, model, run_id: int, *where) -> int:
    return session.scalar(select(func.count()).select_from(model).where(model.run_id == run_id, *where)) or 0


#: A run holding no row at all (no rank, graph, trace, FR or compile record): said, not shown as a run.
EMPTY_NOTE = ("empty: nothing was recorded (no rank, graph, trace or record): a job killed before its first "
              "write, or one still starting")


def holds_rows(session: Session, run_id: int) -> bool:
    """Whether any table with a ``run_id`` holds a row of the run (an index seek per table)."""
    from sqlalchemy import exists

    from graphdeck.store.schema import Base

    for table in Base.metadata.sorted_tables:
        col = table.columns.get("run_id")
        if col is not None and session.scalar(select(exists().where(col == run_id))):
            return True
    return False


def run_summary(session: Session, run: Run) -> dict:
    """One run's line: ids, counts, ``state`` (``recorded``, or ``empty`` with ``note`` :data:`EMPTY_NOTE`)."""
    from graphdeck.store.replay_runs import source_of

    counts = {"num_ranks": _count(session, Rank, run.id), "num_graphs": _count(session, Graph, run.id),
              "num_traces": _count(session, Trace, run.id, Trace.status != "ingesting")}
    has_rows = any(counts.values()) or holds_rows(session, run.id)
    return {"id": run.id, "name": run.name, "world_size": run.world_size,
            "state": "recorded" if has_rows else "empty", **({} if has_rows else {"note": EMPTY_NOTE}),
            "created_at": run.created_at.isoformat() if run.created_at else None,
            "source_run": source_of(session, run), **counts}


@router.get("/api/runs")
def list_runs(session: Session = Depends(get_session), _swept: None = Depends(sweep_dead)) -> list[dict]:
    """Every run, newest first, with its rank, graph and trace counts and ``state``: ``empty`` (with
    ``note``) for a run row that holds nothing, e.g. left by a job killed before its first write."""
    runs = session.scalars(select(Run).order_by(Run.id.desc())).all()
    return [run_summary(session, r) for r in runs]


def _graphs(session: Session, run: Run, rank: int | None = None, kind: str | None = None) -> list[dict]:
    q = select(Graph).where(Graph.run_id == run.id)
    if rank is not None:
        q = q.where(Graph.rank == rank)
    if kind is not None:
        q = q.where(Graph.kind == kind)
    return [pick(g, GRAPH_FIELDS) for g in session.scalars(q.order_by(Graph.rank, Graph.ordinal))]


@router.get("/api/runs/{run_id}")
def get_run(_swept: None = Depends(sweep_dead), run: Run = Depends(resolve_run),
            session: Session = Depends(get_session)) -> dict:
    """The run with its ranks, graphs (every kind, capture order per rank), traces (complete or
    truncated; ones still being written are left out), DDP bucket partitions, and ``replays``: its
    replay runs with their traces (NOTE: [Replay runs] in :mod:`graphdeck.store.replay_runs`; a replay
    run's ``source_run`` names the run it replays)."""
    from graphdeck.store.replay_runs import replays_of

    ranks = session.scalars(select(Rank).where(Rank.run_id == run.id).order_by(Rank.rank)).all()
    traces = session.scalars(select(Trace).where(Trace.run_id == run.id, Trace.status != "ingesting")
                             .order_by(Trace.rank, Trace.id)).all()
    parts = session.scalars(select(Partition).where(Partition.run_id == run.id)
                            .order_by(Partition.rank, Partition.parent_graph_id, Partition.index)).all()
    return {**run_summary(session, run), "meta": json.loads(run.meta_json or "{}"),
            "ranks": [pick(r, RANK_FIELDS) for r in ranks],
            "graphs": _graphs(session, run),
            "traces": [pick(t, TRACE_FIELDS) for t in traces],
            "replays": replays_of(session, run),
            "partitions": [{"rank": p.rank, "kind": p.kind, "index": p.index, "size_bytes": p.size_bytes,
                            "params": json.loads(p.params_json), "graph_id": p.graph_id,
                            "parent_graph_id": p.parent_graph_id} for p in parts]}


@router.get("/api/runs/{run_id}/ranks")
def get_ranks(run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> list[dict]:
    return [pick(r, RANK_FIELDS) for r in
            session.scalars(select(Rank).where(Rank.run_id == run.id).order_by(Rank.rank))]


@router.delete("/api/runs/{run_id}")
async def delete_run(request: Request, run_id: str, engine=Depends(get_engine)) -> dict:
    """Delete the run (by id, or by name) and every row of it: ranks, parameters, graphs with
    their nodes and edges, partitions, compile records, gradient evidence, traces with their
    events; the upload markers naming it go too, so the same file can be uploaded again.
    Answers ``{"ok": true, "run_id", "run_name", "rows": {table: deleted}}``; 404 for no such run."""
    from graphdeck.store.db import delete_run as delete_rows

    def work() -> dict:
        lock = getattr(request.app.state, "merge_lock", None) or threading.Lock()  # not amid an upload's merge
        with lock, Session(engine) as session:
            target = find_run(session, run_id).id
            session.rollback()
            return delete_rows(engine, target)

    result = await run_in_threadpool(work)
    cache = getattr(request.app.state, "svg_cache", None)
    if cache is not None:  # a deleted graph's id may be given to a new graph
        cache.clear()
    return {"ok": True, **result}


@router.get("/api/runs/{run_id}/graphs")
def get_graphs(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
               rank: int | None = Depends(rank_query),
               kind: str | None = Query(None, description="dynamo, ddp_partition, aot_forward, aot_backward, aot_inference")) -> list[dict]:
    return _graphs(session, run, rank, kind)
