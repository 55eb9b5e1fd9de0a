"""The live watch's route: ``GET /api/runs/{run}/live`` — each rank's heartbeat (its step, per
process group the last collective enqueued and completed, the heartbeat's age) and the live hang
report once the agents wrote it (NOTE: [Live watch] in graphdeck/capture/heartbeat.py). The run
page polls it while the job runs (frontend/live.js)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.live import live_state
from graphdeck.server.deps import RunPathRoute, get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["runs"], route_class=RunPathRoute)


@router.get("/api/runs/{run_id}/live")
def run_live(response: Response, run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """The run's live state now (:func:`graphdeck.analysis.ranks.live.live_state`: ``state`` none |
    running | stalled | hang | ended | silent, ``ranks`` with step, groups and ``beat_age_s``,
    ``report``: the stored live hang report or null). Never cached: each poll reads the store."""
    response.headers["Cache-Control"] = "no-store"
    return live_state(session, run.id, world_size=run.world_size)
