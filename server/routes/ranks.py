"""Cross-rank routes: the consistency report of a run, and the graphs a graph can be diffed with
(the same compile on other ranks; the previous compile of the same frame, with the reason it
recompiled)."""

from __future__ import annotations

import re

from fastapi import APIRouter, Depends
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import compile_sequence, rank_report
from graphdeck.server.deps import get_session, resolve_graph, resolve_run
from graphdeck.store.schema import Graph, Run

router = APIRouter(tags=["ranks"])


@router.get("/api/runs/{run_id}/rank-consistency")
def run_rank_consistency(run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """Ranks grouped by identical compile sequences; per diverging group the first differing
    compile, graph and node (source line, module path); per rank the collective schedule; the
    first collective where ranks disagree (a predicted hang). ``ok`` is false on any divergence."""
    return rank_report(session, run).to_dict()


@router.get("/api/graphs/{graph_id}/counterparts")
def graph_counterparts(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session)) -> dict:
    """Graphs to diff ``graph`` against: ``ranks`` — the graph at the same compile id, kind and
    position on every other rank; ``previous`` — the same kind and position in the previous compile
    of the same frame on this rank (``"f/c-1"``), with ``recompile_reason`` of this compile."""
    siblings = session.scalars(select(Graph).where(
        Graph.run_id == graph.run_id, Graph.rank == graph.rank, Graph.compile_id == graph.compile_id,
        Graph.kind == graph.kind).order_by(Graph.ordinal)).all()
    position = next((i for i, g in enumerate(siblings) if g.id == graph.id), 0)

    def nth(rank: int, compile_id: str | None) -> Graph | None:
        found = session.scalars(select(Graph).where(
            Graph.run_id == graph.run_id, Graph.rank == rank, Graph.compile_id == compile_id,
            Graph.kind == graph.kind).order_by(Graph.ordinal)).all()
        return found[position] if position < len(found) else None

    ranks = []
    for r in sorted(set(session.scalars(select(Graph.rank).where(Graph.run_id == graph.run_id)))):
        if r == graph.rank:
            continue
        other = nth(r, graph.compile_id)
        ranks.append({"rank": r, "graph_id": other.id if other else None,
                      "same_hash": bool(other and other.structural_hash == graph.structural_hash)})
    previous = None
    m = re.fullmatch(r"(.*?)(\d+)/(\d+)(_\d+)?", graph.compile_id or "")
    if m and int(m.group(3)) > 0:
        prev_id = f"{m.group(1)}{m.group(2)}/{int(m.group(3)) - 1}"
        prev = nth(graph.rank, prev_id)
        reason = next((e.recompile_reason for e in compile_sequence(session, graph.run_id, graph.rank)
                       if e.compile_id == graph.compile_id), None)
        previous = {"compile_id": prev_id, "graph_id": prev.id if prev else None, "recompile_reason": reason}
    return {"graph_id": graph.id, "rank": graph.rank, "compile_id": graph.compile_id, "kind": graph.kind,
            "ranks": ranks, "previous": previous}
