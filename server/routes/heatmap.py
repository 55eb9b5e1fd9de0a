"""The rank heatmap of a run (issue 26 item 2; NOTE: [Rank heatmap] in
graphdeck/analysis/heatmap.py): ranks × steps or ranks × collectives as one matrix, for the pages
that list ranks."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from graphdeck.analysis.heatmap import MAX_COLUMNS, rank_heatmap
from graphdeck.server.deps import RunPathRoute, get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["runs"], route_class=RunPathRoute)


@router.get("/api/runs/{run_id}/heatmap")
def get_heatmap(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                metric: str = Query("step_time", description="step_time | lateness | wait | finding"),
                axis: str = Query("steps", description="steps | collectives"),
                max_columns: int = Query(MAX_COLUMNS, ge=1, le=4096,
                                         description="more collectives than this share columns")) -> dict:
    """One matrix: ``ranks`` (rows), ``columns``, ``values`` (one list per rank: ns, or a finding
    code of ``findings``; null = no value), ``row_state`` (``no_trace``: missing evidence) and
    ``trace_ids`` per rank for drilling down. 400 for an unknown metric or axis, or ``step_time``
    per collective; 404 for an unknown run."""
    return rank_heatmap(session, run, metric, axis, max_columns)
