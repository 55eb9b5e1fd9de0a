"""Validation routes: the gradient-path report of a run (graph mode), as JSON or JUnit XML.

The dashboard's gradient page (``#/runs/<id>/grads``) renders the JSON; CI can fetch the JUnit
XML twin. Filters narrow the listed rows only: ``ok``, ``summary`` and ``findings`` always cover
the whole run.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from sqlalchemy.orm import Session

from graphdeck.analysis.grad_report import STATUSES
from graphdeck.analysis.gradients import gradient_report
from graphdeck.errors import BadInputError
from graphdeck.server.deps import get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["validation"])


def _report(run: Run, session: Session, allow: list[str], buffers: bool):
    return gradient_report(session, run, include_buffers=buffers, allow=allow)


@router.get("/api/runs/{run_id}/gradients")
def run_gradients(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                  status: list[str] = Query(default=[], description="Keep rows with these statuses"),
                  rank: list[int] = Query(default=[], description="Keep rows of these ranks"),
                  allow: list[str] = Query(default=[], description="fnmatch patterns of parameters unused on purpose"),
                  buffers: bool = Query(default=False, description="List buffers too (status BUFFER)")) -> dict:
    """For every trainable parameter on every rank: OK, NO_GRAD, NOT_IN_GRAPH, DEAD_END, FROZEN
    (BUFFER with ``buffers``), with paths, the cut point (op, node, graph, file:line, module
    path), the DDP bucket, and run-level findings (predicted DDP error or hang, collectives).
    ``ok`` is false when any parameter fails (and is not allowed) or a finding is an error.

    Raises 400 for an unknown status."""
    bad = [s for s in status if s not in STATUSES]
    if bad:
        raise BadInputError(f"unknown status {', '.join(bad)}; expected one of {', '.join(STATUSES)}")
    report = _report(run, session, allow, buffers)
    out = report.to_dict()
    if status or rank:
        out["params"] = [p for p in out["params"]
                         if (not status or p["status"] in status) and (not rank or p["rank"] in rank)]
        out["filtered"] = {"status": status, "rank": rank}
    return out


@router.get("/api/runs/{run_id}/gradients.junit", response_class=Response,
            responses={200: {"content": {"application/xml": {}}}})
def run_gradients_junit(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                        allow: list[str] = Query(default=[], description="fnmatch patterns allowed to fail")) -> Response:
    """The same report as JUnit XML (one testsuite per rank, one testcase per parameter)."""
    return Response(_report(run, session, allow, False).to_junit(), media_type="application/xml")
