"""The run overview (issue 23 item 2): every check's verdict with a count and a link, and the
slowest ranks and steps, as one JSON document (NOTE: [Run overview] in
graphdeck/analysis/summary.py). The run page's overview and ``graphdeck summary RUN`` read the
same function, so the page and a CI log agree."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from sqlalchemy.orm import Session

from graphdeck.analysis.summary import run_check, run_summary
from graphdeck.server.deps import RunPathRoute, get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["runs"], route_class=RunPathRoute)


@router.get("/api/runs/{run_id}/summary")
def get_run_summary(run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """``verdict`` (PASS / FAIL / INCOMPLETE) and ``exit_code`` (0 / 1 / 3, as ``graphdeck summary``
    exits); ``checks``, worst first: per check (``gradients``, ``ranks``, ``compile``, ``traces``,
    ``layout``) ``verdict`` (PASS | FAIL | INCOMPLETE | ERROR: the check raised | N/A: nothing to
    check), ``count`` and ``count_label``, ``headline``, ``reasons`` (first findings and
    missing-evidence lines), ``link`` (dashboard route), ``command`` (its CLI), ``api``,
    ``elapsed_s`` against ``budget_s``; ``slowest``: the longest steps (``dur_ns``) and ranks
    (median step ns) from the traces, with the straggler when ranks were matched. 404 for an
    unknown run."""
    return run_summary(session, run).to_dict()


@router.get("/api/runs/{run_id}/summary/{part}")
def get_run_summary_part(part: str, run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """One part of the summary, so the run page draws each check as it arrives instead of waiting
    for the slowest: ``part`` is a check (``gradients``, ``ranks``, ``compile``, ``traces``,
    ``layout``: one entry of ``checks`` above) or ``slowest``. 400 naming the parts for another
    ``part``; 404 for an unknown run."""
    return run_check(session, run, part)
