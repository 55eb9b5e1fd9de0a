"""Validation routes: the gradient-path report of a run (graph mode), as JSON or JUnit XML.

The dashboard's gradient page (``#/runs/<id>/grads``) renders the JSON; CI can fetch the JUnit
XML twin. Filters narrow the listed rows only: ``ok``, ``summary`` and ``findings`` always cover
the whole run. ``/gradients/steps`` is the JSON twin of the page's step × rank strips: what arrived
per parameter, per rank, per step (run-time evidence, analysis.gradients.evidence).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.core import gradient_report
from graphdeck.analysis.gradients.report import STATUSES
from graphdeck.errors import BadInputError, NotFoundError
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
                  buffers: bool = Query(default=False, description="List buffers too (status BUFFER)"),
                  allow_incomplete: bool = Query(default=False, description="Evidence that does not cover the "
                                                 "run (ranks, steps, parameter list) does not make it INCOMPLETE")) -> dict:
    """For every trainable parameter on every rank: OK, NO_GRAD, NOT_IN_GRAPH, DEAD_END, FROZEN
    (BUFFER with ``buffers``), with paths, the cut point (op, node, graph, file:line, module
    path), the DDP bucket, and run-level findings (predicted DDP error or hang, collectives).
    ``ok`` is false when any parameter fails (and is not allowed) or a finding is an error;
    ``verdict`` is PASS, FAIL or INCOMPLETE (the evidence does not cover the run, see
    ``incomplete``; PASS instead with ``allow_incomplete``).

    Raises 400 for an unknown status."""
    bad = [s for s in status if s not in STATUSES]
    if bad:
        raise BadInputError(f"unknown status {', '.join(bad)}; expected one of {', '.join(STATUSES)}")
    report = _report(run, session, allow, buffers)
    report.allow_incomplete = allow_incomplete
    out = report.to_dict()
    if status or rank:
        out["params"] = [p for p in out["params"]
                         if (not status or p["status"] in status) and (not rank or p["rank"] in rank)]
        out["filtered"] = {"status": status, "rank": rank}
    return out


@router.get("/api/runs/{run_id}/gradients/steps")
def run_gradient_steps(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                       fqn: list[str] = Query(default=[], description="Parameters to show (default: every one "
                                                                      "with a step that is not ok)"),
                       rank: list[int] = Query(default=[], description="Keep these ranks")) -> dict:
    """Per parameter, per rank, its step strip: ``strips[fqn][rank]`` = ``[[first, last, state], …]``
    (steps inclusive; state ok | none | zero | multi | frozen | unobserved), with ``first_bad[fqn][rank]``
    (the first step without a real gradient), the report's ``coverage`` and ``incomplete`` reasons,
    and the run's step range ``steps`` (``null`` without run-time evidence). Without ``fqn``: every
    parameter with a segment that is not ok, and ``all_ok``, how many parameters were ok throughout.

    Raises 404 for a parameter name the run does not have."""
    from graphdeck.analysis.gradients import evidence as GE

    report = _report(run, session, [], False)
    ev = GE.load(session, run.id)
    names: dict[str, list[str]] = {}  # fqn -> the names it is known by (tied weights)
    for row in report.rows:
        if row.status != "BUFFER":
            names.setdefault(row.fqn, list(dict.fromkeys([row.fqn, *row.aliases])))
    unknown = [f for f in fqn if f not in names]
    if unknown:
        raise NotFoundError(f"run {run.name!r} has no parameter {', '.join(map(repr, unknown))}",
                            resource="parameter", id=unknown[0])
    ranks = [r for r in sorted(ev.by_rank) if not rank or r in rank]
    everything = {f: {r: GE.timeline(ev, r, names[f]) for r in ranks} for f in (fqn or sorted(names))}
    if fqn:
        shown, all_ok = everything, None
    else:
        shown = {f: per for f, per in everything.items()
                 if any(state != "ok" for segs in per.values() for _, _, state in segs)}
        all_ok = sum(1 for per in everything.values() if per) - len(shown)
    segs = [seg for s in ev.by_rank.values() for seg in s]
    return {"run_id": run.id, "run": run.name, "verdict": report.verdict, "ranks": ranks,
            "steps": {"first": min(s.first for s in segs), "last": max(s.last for s in segs)} if segs else None,
            "coverage": report.coverage, "incomplete": report.incomplete,
            "strips": shown, "all_ok": all_ok,
            "first_bad": {f: {r: next((a for a, _, st in tl if st in ("none", "zero")), None) for r, tl in per.items()}
                          for f, per in shown.items()},
            "filtered": {"fqn": fqn, "rank": rank}}


@router.get("/api/runs/{run_id}/gradients.junit", response_class=Response,
            responses={200: {"content": {"application/xml": {}}}})
def run_gradients_junit(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                        allow: list[str] = Query(default=[], description="fnmatch patterns allowed to fail")) -> Response:
    """The same report as JUnit XML (one testsuite per rank, one testcase per parameter)."""
    return Response(_report(run, session, allow, False).to_junit(), media_type="application/xml")
