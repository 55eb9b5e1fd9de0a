"""Run routes: the list of runs, one run with its ranks, graphs, traces and DDP partitions."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Query
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.server.deps import get_session, resolve_run
from graphdeck.store.schema import Graph, Partition, Rank, Run, Trace

router = APIRouter(tags=["runs"])

GRAPH_FIELDS = ("id", "rank", "ordinal", "kind", "name", "compile_id", "frame_name", "num_nodes", "parent_id",
                "partition_index", "compile_time_s", "break_reason", "structural_hash", "backend")
RANK_FIELDS = ("rank", "world_size", "hostname", "pid", "backend", "torch_version")
TRACE_FIELDS = ("id", "rank", "name", "status", "num_events", "start_ns", "end_ns")


def pick(row, fields) -> dict:
    return {f: getattr(row, f) for f in fields}


def _count(session: Session, model, run_id: int, *where) -> int:
    return session.scalar(select(func.count()).select_from(model).where(model.run_id == run_id, *where)) or 0


def run_summary(session: Session, run: Run) -> dict:
    return {"id": run.id, "name": run.name, "world_size": run.world_size,
            "created_at": run.created_at.isoformat() if run.created_at else None,
            "num_ranks": _count(session, Rank, run.id), "num_graphs": _count(session, Graph, run.id),
            "num_traces": _count(session, Trace, run.id, Trace.status != "ingesting")}


@router.get("/api/runs")
def list_runs(session: Session = Depends(get_session)) -> list[dict]:
    """Every run, newest first, with its rank, graph and trace counts."""
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
def get_run(run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """The run with its ranks, graphs (every kind, capture order per rank), traces (complete or
    truncated; ones still being written are left out) and DDP bucket partitions."""
    ranks = session.scalars(select(Rank).where(Rank.run_id == run.id).order_by(Rank.rank)).all()
    traces = session.scalars(select(Trace).where(Trace.run_id == run.id, Trace.status != "ingesting")
                             .order_by(Trace.rank, Trace.id)).all()
    parts = session.scalars(select(Partition).where(Partition.run_id == run.id)
                            .order_by(Partition.rank, Partition.parent_graph_id, Partition.index)).all()
    return {**run_summary(session, run), "meta": json.loads(run.meta_json or "{}"),
            "ranks": [pick(r, RANK_FIELDS) for r in ranks],
            "graphs": _graphs(session, run),
            "traces": [pick(t, TRACE_FIELDS) for t in traces],
            "partitions": [{"rank": p.rank, "kind": p.kind, "index": p.index, "size_bytes": p.size_bytes,
                            "params": json.loads(p.params_json), "graph_id": p.graph_id,
                            "parent_graph_id": p.parent_graph_id} for p in parts]}


@router.get("/api/runs/{run_id}/ranks")
def get_ranks(run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> list[dict]:
    return [pick(r, RANK_FIELDS) for r in
            session.scalars(select(Rank).where(Rank.run_id == run.id).order_by(Rank.rank))]


@router.get("/api/runs/{run_id}/graphs")
def get_graphs(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
               rank: int | None = Query(None, description="only this rank"),
               kind: str | None = Query(None, description="dynamo, ddp_partition, aot_forward, aot_backward, aot_inference")) -> list[dict]:
    return _graphs(session, run, rank, kind)
