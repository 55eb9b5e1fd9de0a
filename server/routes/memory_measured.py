"""Memory route: the measured memory of a CUDA memory snapshot beside the graph-derived step
models, for the memory page (NOTE: [Measured beside derived])."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from graphdeck.server.deps import get_session, resolve_graph
from graphdeck.store.schema import Graph

router = APIRouter(tags=["memory"])


@router.get("/api/graphs/{graph_id}/memory/measured")
def get_measured(graph: Graph = Depends(resolve_graph), session: Session = Depends(get_session),
                 depth: int = Query(3, ge=1, le=12, description="module path parts kept when grouping per module"),
                 top: int = Query(15, ge=1, le=200, description="modules listed")) -> dict:
    """The run's latest snapshot record for the graph's rank (``graphdeck import SNAPSHOT``):
    ``status`` ``ok`` or ``incomplete`` (no snapshot: ``message`` says so, the graph-derived and
    Inductor peaks still listed without a gap), ``snapshot`` (peak, baseline, allocations,
    attributed, bytes per category), ``curve`` (``t_us`` µs since the first event and ``bytes``
    allocated, at most 2,000 points), ``peaks`` (measured, graph-derived step, Inductor buffer
    model: ``peak_bytes``, ``held_outside_bytes``, ``compared_bytes``, ``gap_bytes`` / ``gap_pct``
    vs measured), ``modules`` (bytes live at each side's peak per module path cut to ``depth``
    parts, parameters left out), ``notes``. 404 when the graph does not exist."""
    from graphdeck.analysis.memory.compare import compare

    return compare(session, graph.id, depth=depth, top=top)
