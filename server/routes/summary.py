"""The run overview (issue 23 item 2): every check's verdict with a count and a link, and the
slowest ranks and steps, as one JSON document (NOTE: [Run overview] in
graphdeck/analysis/summary.py). The run page's overview and ``graphdeck summary RUN`` read the
same function, so the page and a CI log agree.

Each part is kept once computed (NOTE: [Derived-document cache] in graphdeck/server/derived.py):
a 1,024-rank run's checks cost seconds each, paid once per state of the run, not per page. A part
that raised (``ERROR``), ran over its budget or could not read its evidence is not kept."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from sqlalchemy.orm import Session

from graphdeck.analysis.summary import (
    BUDGETS_S,
    CHECKS,
    PARTS,
    SEVERITY,
    CheckSummary,
    RunSummary,
    _run_ranks,
    run_check,
)
from graphdeck.errors import BadInputError
from graphdeck.server.deps import RunPathRoute, get_session, resolve_run
from graphdeck.server.derived import cached
from graphdeck.store.schema import Run

router = APIRouter(tags=["runs"], route_class=RunPathRoute)


def _keep(doc: dict) -> bool:
    """Whether a part's answer may be kept: not an ERROR, not cut short by its budget, its
    evidence read (``slowest``: not "could not be read")."""
    if doc.get("verdict") == "ERROR" or doc.get("over_budget"):
        return False
    if any("budget was spent" in str(r) for r in doc.get("reasons") or []):
        return False
    return not str(doc.get("reason") or "").startswith("step times could not be read")


def summary_part(request: Request, session: Session, run: Run, part: str) -> dict:
    """One part (a check of ``CHECKS`` or ``slowest``) from the derived-document cache or computed
    now; ``cache`` says which (``memory`` | ``store`` | ``computed``). Raises BadInputError (400)
    for another part."""
    if part not in PARTS:
        raise BadInputError(f"unknown overview part {part!r}: use one of {', '.join(PARTS)}")
    doc, source = cached(session, run, f"summary:{part}", lambda: run_check(session, run, part),
                         writer=request.app.state.engine, keep=_keep)
    return {**doc, "cache": source}


@router.get("/api/runs/{run_id}/summary")
def get_run_summary(request: Request, run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """``verdict`` (PASS / FAIL / INCOMPLETE) and ``exit_code`` (0 / 1 / 3, as ``graphdeck summary``
    exits); ``checks``, worst first: per check (``gradients``, ``ranks``, ``compile``, ``traces``,
    ``layout``) ``verdict`` (PASS | FAIL | INCOMPLETE | ERROR: the check raised | N/A: nothing to
    check), ``count`` and ``count_label``, ``headline``, ``reasons`` (first findings and
    missing-evidence lines), ``link`` (dashboard route), ``command`` (its CLI), ``api``,
    ``elapsed_s`` against ``budget_s`` (of the computation, which may be an earlier one: each
    check's ``cache`` says), ``cache``; ``slowest``: the longest steps (``dur_ns``) and ranks
    (median step ns) from the traces, with the straggler when ranks were matched. 404 for an
    unknown run."""
    t0 = time.perf_counter()
    parts = {p: summary_part(request, session, run, p) for p in PARTS}
    fields = set(CheckSummary.__dataclass_fields__)
    checks = []
    for k in CHECKS:
        c = CheckSummary(**{f: v for f, v in parts[k].items() if f in fields})
        checks.append((c, parts[k]["cache"]))
    checks.sort(key=lambda x: (SEVERITY.index(x[0].verdict), CHECKS.index(x[0].key)))
    out = RunSummary(run.id, run.name, run.world_size, _run_ranks(session, run.id), [c for c, _ in checks],
                     parts["slowest"], time.perf_counter() - t0).to_dict()
    for d, (_, source) in zip(out["checks"], checks):
        d["cache"] = source
    out["budgets_s"] = BUDGETS_S
    return out


@router.get("/api/runs/{run_id}/summary/{part}")
def get_run_summary_part(part: str, request: Request, run: Run = Depends(resolve_run),
                         session: Session = Depends(get_session)) -> dict:
    """One part of the summary, so the run page draws each check as it arrives instead of waiting
    for the slowest: ``part`` is a check (``gradients``, ``ranks``, ``compile``, ``traces``,
    ``layout``: one entry of ``checks`` above) or ``slowest``; ``cache`` says whether it was
    computed now or kept from an earlier request (NOTE: [Derived-document cache]). 400 naming the
    parts for another ``part``; 404 for an unknown run."""
    return summary_part(request, session, run, part)
