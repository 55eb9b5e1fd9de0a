"""The per-rank cost view (issue 42 item 4; NOTE: [Rank cost view] in analysis/ranks/cost.py):
``GET /api/runs/{run_id}/costs?step=&sort=&desc=``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from graphdeck.server.deps import RunPathRoute, get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["ranks"], route_class=RunPathRoute)


@router.get("/api/runs/{run_id}/costs")
def run_costs(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
              step: int | None = Query(None, description="ProfilerStep number (default: the step most traced ranks have)"),
              sort: str | None = Query(None, max_length=40, description="a metric, or rank (default: rank order)"),
              desc: bool = Query(True, description="largest first (rows without a value always last)")) -> dict:
    """One row per rank, one column per metric (step time, collectives' count, bytes and time in
    the step, peak memory, compile time), each cell with the link to the page it comes from
    (:func:`graphdeck.analysis.ranks.cost.rank_costs`). An unknown ``sort`` is a 400 naming it."""
    from graphdeck.analysis.ranks.cost import rank_costs

    return rank_costs(session, run, step=step, sort=sort, descending=desc)
