"""Validation routes: the gradient-path report of a run (JSON; the dashboard renders it)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients import gradient_report
from graphdeck.server.deps import get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["validation"])


@router.get("/api/runs/{run_id}/gradients")
def run_gradients(run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """For every trainable parameter on every rank: OK, NO_GRAD, NOT_IN_GRAPH or FROZEN, with the
    reason, the graphs that read it and the backward graphs that bind its gradient.
    ``ok`` is false when any parameter is NO_GRAD or NOT_IN_GRAPH, or statuses differ by rank."""
    return gradient_report(session, run).to_dict()
