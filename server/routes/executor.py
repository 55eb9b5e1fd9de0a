"""Executor routes: a graph's pipeline stage table, and the node times of its executor traces.

Both answer overlays in the model of :mod:`graphdeck.analysis.parallel.overlays` (values keyed by node
name) so the graph view can draw them: ``stage`` (categorical: node → stage index) and ``time``
(ns per node from an executor trace). Read-only; torch is not imported (partitioning works on
store rows; running the executor is the CLI's job, ``graphdeck replay``).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.parallel.overlays import Overlay
from graphdeck.errors import NotFoundError
from graphdeck.replay.executor import node_times_from_trace, recorded_node_ns
from graphdeck.replay.partition import STRATEGIES, plan_for_graph
from graphdeck.server.deps import get_session, resolve_graph
from graphdeck.store.replay_runs import executor_traces
from graphdeck.store.schema import Graph, Trace

router = APIRouter(tags=["executor"])


@router.get("/api/graphs/{graph_id}/stages")
def get_stages(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session),
               workers: int = Query(2, ge=1, le=64, description="number of stages K"),
               strategy: str = Query("layerwise", description="one of " + ", ".join(STRATEGIES)),
               trace_id: int | None = Query(None, description="trace whose node times to use (default: newest "
                                                              "that maps onto the graph)")) -> dict:
    """The stage table of ``graph`` split into ``workers`` stages with ``strategy``: per stage its
    nodes, compute-node count, parameter / activation / peak live bytes, estimated time (ns, when
    a trace maps onto the graph), the boundary tensors it receives and sends; ``balance`` (max /
    mean of the strategy's cost), ``time_balance``; ``overlay``: node name → stage. 400 for an
    unknown strategy, or ``auto`` with no trace that maps onto the graph."""
    if trace_id is not None and session.get(Trace, trace_id) is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    plan = plan_for_graph(session, graph.id, workers, strategy, trace_id=trace_id)
    out = plan.to_dict()
    out["overlay"] = Overlay(kind="stage", unit="", categorical=True, values=plan.assignment).model_dump()
    return out


@router.get("/api/graphs/{graph_id}/executor")
def get_executor(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session),
                 trace_id: int | None = Query(None, description="an executor trace of this graph (default: newest)")
                 ) -> dict:
    """The executor traces of ``graph`` (``executor graph <id>``, and ``… worker s/K`` of pipeline
    runs) in the replay runs of its run (NOTE: [Replay runs] in :mod:`graphdeck.store.replay_runs`), and for one of them (``trace_id``, default the newest single-worker one) the mean CPU
    and GPU ns per node as a ``time`` overlay, plus the ratio to the recorded trace's time per node
    (``executor / recorded``) where a recorded trace maps onto the graph."""
    prefix = f"executor graph {graph.id}"
    ids = [t for t, _n in executor_traces(session, graph)]
    traces = session.execute(
        select(Trace.id, Trace.name, Trace.status, Trace.num_events, Trace.run_id, Trace.rank)
        .where(Trace.id.in_(ids)).order_by(Trace.id)).all() if ids else []
    listed = [{"id": t, "name": n, "status": s, "num_events": e, "run_id": r, "rank": k}
              for t, n, s, e, r, k in traces]
    if trace_id is None:
        single = [t["id"] for t in listed if t["name"] == prefix]
        trace_id = single[-1] if single else (listed[-1]["id"] if listed else None)
    elif trace_id not in {t["id"] for t in listed}:
        raise NotFoundError(f"trace {trace_id} is not an executor trace of graph {graph.id}", resource="trace",
                            id=trace_id)
    out: dict = {"graph_id": graph.id, "traces": listed, "trace_id": trace_id}
    if trace_id is None:
        out["overlay"] = Overlay(kind="time", unit="ns", note="no executor trace: run `graphdeck replay`").model_dump()
        return out
    cpu, gpu = node_times_from_trace(session, trace_id, graph.id)
    mine = gpu or cpu
    rec_id, rec = recorded_node_ns(session, graph.id, exclude={t["id"] for t in listed})
    out.update(node_cpu_ns=cpu, node_gpu_ns=gpu, recorded_trace_id=rec_id,
               ratio={k: round(mine[k] / v, 4) for k, v in sorted(rec.items()) if v and k in mine})
    out["overlay"] = Overlay(kind="time", unit="ns", values=mine).model_dump()
    return out
