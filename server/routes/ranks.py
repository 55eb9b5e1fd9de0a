"""Cross-rank routes: the consistency report of a run, and the graphs a graph can be diffed with
(the same compile on other ranks; the previous compile of the same frame, with the reason it
recompiled)."""

from __future__ import annotations

import re

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import compile_sequence, rank_report
from graphdeck.server.deps import get_session, get_svg_cache, resolve_graph, resolve_run
from graphdeck.server.render.svg import SvgCache
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

    from graphdeck.analysis.ranks.nway import graph_keys  # NOTE: [N-way rank diff]: one key, every rank

    keys = graph_keys(session, graph.run_id)
    members = next((m for m in keys.values() if m.get(graph.rank, (None,))[0] == graph.id), {})
    everyone = sorted({r for m in keys.values() for r in m})
    ranks = [{"rank": r, "graph_id": members[r][0] if r in members else None,
              "same_hash": bool(r in members and members[r][1] == graph.structural_hash)}
             for r in everyone if r != graph.rank]
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


# ---------------------------------------------------------------- the N-way rank diff (issue 42)

_GRAPH_Q = Query(None, min_length=1, max_length=300,
                 description="the graph: a key 'compile_id:kind[:position]' (e.g. '0/0:aot_forward') or a graph id "
                             "of the run; omitted: the run's graph keys")
_RANKS_Q = Query(None, max_length=2000, description="ranks to compare: all (default) or ranks and ranges, 0,2-5")
_BASE_Q = Query(None, ge=0, le=10**7, description="base the view on this rank's class (default: the largest class)")


def _nway(session: Session, run: Run, graph: str, ranks: str | None, base: int | None, times: bool = True):
    from graphdeck.analysis.ranks.nway import nway_report

    return nway_report(session, run, graph, ranks, base, times=times)


@router.get("/api/runs/{run_id}/graphs/nway")
def run_graph_nway(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                   graph: str | None = _GRAPH_Q, ranks: str | None = _RANKS_Q, base: int | None = _BASE_Q) -> dict:
    """The N-way rank diff of one graph (NOTE: [N-way rank diff] in analysis/ranks/nway.py):
    ``classes`` (ranks with the same graph; ``status`` base / same / note / differs / missing, ``why``),
    ``nodes`` (merged-graph nodes where a rank differs: ``differs`` grouped by what the ranks do,
    ``mark``), ``times`` (node id → {rank: ns}), ``time_ranks``, ``notes``, ``verdict`` (OK / FAIL /
    INCOMPLETE). Without ``graph``: ``{"graphs": [{"key", "kind", "ranks", "fingerprints"}]}``, the
    run's graph keys. 404: unknown run or graph; 400: a bad ``ranks`` or ``base``."""
    if graph is None:
        from graphdeck.analysis.ranks.nway import graph_keys

        return {"run": run.name, "graphs": [
            {"key": k, "kind": k.rsplit(":", 2)[1], "ranks": len(m), "fingerprints": len({h for _g, h in m.values()})}
            for k, m in graph_keys(session, run.id).items()]}
    return _nway(session, run, graph, ranks, base).to_dict()


@router.get("/api/runs/{run_id}/graphs/nway.svg", response_class=Response,
            responses={200: {"content": {"image/svg+xml": {}}}})
def run_graph_nway_svg(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                       cache: SvgCache = Depends(get_svg_cache), graph: str = Query(..., min_length=1, max_length=300),
                       ranks: str | None = _RANKS_Q, base: int | None = _BASE_Q) -> Response:
    """The merged graph of the N-way rank diff as SVG (``render/svg.py``): every module open, nodes
    where a rank differs marked ``diff-changed`` / ``diff-removed`` / ``diff-added`` (a divergence)
    or ``diff-note`` (the layout explains it); a node only some ranks have is drawn as
    ``<name>`` or ``<name>@r<rank>``."""
    report = _nway(session, run, graph, ranks, base, times=False)
    marks = report.marks()
    state = {"max_depth": 99, "expand": [], "collapse": [], "filter_by_op": [], "focus": None,
             "nway": [run.id, report.key, report.ranks, report.base_rank, sorted(marks.items())]}
    return Response(cache.render(report.merged.view, state, marks=marks), media_type="image/svg+xml")
