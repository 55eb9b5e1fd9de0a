"""The rank heatmap of a run (issue 26 item 2; NOTE: [Rank heatmap] in
graphdeck/analysis/ranks/heatmap.py): ranks × steps or ranks × collectives as one matrix, for the pages
that list ranks; the compact run index a large run's page opens with, and one rank's page (the
heatmap's drill-down)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.heatmap import MAX_COLUMNS, MAX_ROWS, check_heatmap_args, rank_heatmap, run_ranks
from graphdeck.errors import NotFoundError
from graphdeck.server.deps import MAX_RANK, RunPathRoute, get_session, resolve_run
from graphdeck.server.derived import cached
from graphdeck.server.routes.runs import RANK_FIELDS, TRACE_FIELDS, pick
from graphdeck.server.routes.runs import _graphs as graph_rows
from graphdeck.server.routes.runs import run_summary as run_header
from graphdeck.store.schema import Graph, Partition, Rank, Run, Trace

router = APIRouter(tags=["runs"], route_class=RunPathRoute)


@router.get("/api/runs/{run_id}/heatmap")
def get_heatmap(request: Request, run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                metric: str = Query("step_time", description="step_time | lateness | wait | finding"),
                axis: str = Query("steps", description="steps | collectives"),
                max_columns: int = Query(MAX_COLUMNS, ge=1, le=4096,
                                         description="more collectives than this share columns"),
                max_rows: int = Query(MAX_ROWS, ge=1, le=65_536,
                                      description="more ranks than this share rows (the worst kept)")) -> dict:
    """One matrix: ``ranks`` (rows), ``columns``, ``values`` (one list per rank: ns, or a finding
    code of ``findings``; null = no value), ``row_state`` (``no_trace``: missing evidence) and
    ``trace_ids`` per rank for drilling down; past ``max_rows`` ranks, rows are bins of ranks
    (``rank_last``, ``rank_worst``; NOTE: [Rank heatmap]). Kept once computed (NOTE: [Derived-document
    cache]; ``cache`` says where this answer came from). 400 for an unknown metric or axis, or
    ``step_time`` per collective; 404 for an unknown run."""
    check_heatmap_args(metric, axis, max_columns, max_rows)
    doc, source = cached(session, run, f"heatmap:{metric}:{axis}:{max_columns}:{max_rows}",
                         lambda: rank_heatmap(session, run, metric, axis, max_columns, max_rows),
                         writer=request.app.state.engine)
    return {**doc, "cache": source}


#: More ranks than this: a "large" run (the dashboard's SMALL_RUN, frontend/heatmap.js).
SMALL_RUN = 8


@router.get("/api/runs/{run_id}/rank-index")
def get_rank_index(request: Request, run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                   heatmap: str | None = Query(None, description="with more than 8 ranks, also this metric's "
                                               "rank heatmap per step (as GET /heatmap?metric=&axis=steps)")) -> dict:
    """The run's header (as ``GET /api/runs/{id}`` without its lists) and, per rank of
    ``ranks`` (every rank the run knows, ascending), counts: ``graphs``, ``traces`` (complete or
    truncated), ``partitions`` — what a large run's page needs before its heatmap, in a few
    kilobytes instead of every graph of every rank. ``heatmap=METRIC`` and more than
    :data:`SMALL_RUN` ranks: the page's first heatmap under ``heatmap`` too (one round trip for
    the first picture, not two). 400 for an unknown metric; 404 for an unknown run."""
    if heatmap is not None:
        check_heatmap_args(heatmap, "steps")
    return rank_index(session, run, heatmap, request.app.state.engine)


def rank_index(session: Session, run: Run, heatmap: str | None = None, writer=None) -> dict:
    """``GET /rank-index``'s answer (``writer``: the engine that may keep a computed heatmap)."""
    ranks = run_ranks(session, run)

    def per_rank(model, *where) -> list[int]:
        got = dict(session.execute(select(model.rank, func.count()).where(model.run_id == run.id, *where)
                                   .group_by(model.rank)).all())
        return [got.get(r, 0) for r in ranks]

    out = {**run_header(session, run), "meta": json.loads(run.meta_json or "{}"), "ranks": ranks,
           "graphs": per_rank(Graph), "traces": per_rank(Trace, Trace.status != "ingesting"),
           "partitions": per_rank(Partition)}
    if heatmap is not None and len(ranks) > SMALL_RUN:
        doc, source = cached(session, run, f"heatmap:{heatmap}:steps:{MAX_COLUMNS}:{MAX_ROWS}",
                             lambda: rank_heatmap(session, run, heatmap, "steps", MAX_COLUMNS, MAX_ROWS), writer=writer)
        out["heatmap"] = {**doc, "cache": source}
    return out


#: Runs whose first picture a starting server prepares (the newest first).
WARM_RUNS = 2


async def _asgi_get(app, path: str) -> None:
    """One GET of ``path`` through ``app`` in this process, its answer dropped."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"localhost")], "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        return None

    await app(scope, receive, send)


def warm_up(app) -> None:
    """At server start (on a thread): the first request's own costs paid (FastAPI builds each
    route's dependency state lazily, on the first request that scans it: ~0.3 s CPU for graphdeck's
    routes) by a GET of a path no route takes, in process; then the newest large runs' first
    picture prepared — the rank index read once (SQLAlchemy's statement cache, the store's pages),
    the first heatmap loaded from the store or computed (and kept through the app's writer), the
    kept checks loaded. A user who opens the page after the server started gets it at warm speed.
    Errors are logged, never raised."""
    import asyncio
    import logging

    read_engine, writer = app.state.read_engine, getattr(app.state, "engine", None)
    try:
        asyncio.run(_asgi_get(app, "/api/graphdeck-warm-up"))
        with Session(read_engine) as s:
            for run in s.scalars(select(Run).order_by(Run.id.desc()).limit(WARM_RUNS)):
                rank_index(s, run, "step_time", writer=writer)
                from graphdeck.server.derived import run_fingerprint, stored_doc

                fingerprint = run_fingerprint(s, run)
                for part in ("layout", "slowest", "compile", "traces", "ranks", "gradients"):
                    stored_doc(s, run, f"summary:{part}", fingerprint)  # into memory when kept
    except Exception:  # noqa: BLE001 - a warm-up only saves time
        logging.getLogger(__name__).warning("warming the newest runs' pages failed", exc_info=True)


@router.get("/api/runs/{run_id}/ranks/{rank}")
def get_one_rank(rank: int = PathParam(ge=0, le=MAX_RANK), run: Run = Depends(resolve_run),
                 session: Session = Depends(get_session)) -> dict:
    """One rank of the run (the heatmap's drill-down): ``record`` (its rank record, or None),
    ``graphs``, ``traces`` (complete or truncated) and ``partitions``, shaped as in
    ``GET /api/runs/{id}``, plus the run's header under ``run``. 404 for a rank the run does not
    know (outside its world size, no record, graph or trace)."""
    if rank not in run_ranks(session, run):
        raise NotFoundError(f"run {run.name!r} has no rank {rank}", resource="rank", id=rank)
    record = session.scalar(select(Rank).where(Rank.run_id == run.id, Rank.rank == rank))
    traces = session.scalars(select(Trace).where(Trace.run_id == run.id, Trace.rank == rank,
                                                 Trace.status != "ingesting").order_by(Trace.id)).all()
    parts = session.scalars(select(Partition).where(Partition.run_id == run.id, Partition.rank == rank)
                            .order_by(Partition.parent_graph_id, Partition.index)).all()
    return {"run": run_header(session, run), "rank": rank,
            "record": pick(record, RANK_FIELDS) if record else None,
            "graphs": graph_rows(session, run, rank), "traces": [pick(t, TRACE_FIELDS) for t in traces],
            "partitions": [{"rank": p.rank, "kind": p.kind, "index": p.index, "size_bytes": p.size_bytes,
                            "params": json.loads(p.params_json), "graph_id": p.graph_id,
                            "parent_graph_id": p.parent_graph_id} for p in parts]}
