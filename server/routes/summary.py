"""The run overview (issue 23 item 2): every check's verdict with a count and a link, and the
slowest ranks and steps, as one JSON document (NOTE: [Run overview] in
graphdeck/analysis/summary.py). The run page's overview and ``graphdeck summary RUN`` read the
same function, so the page and a CI log agree.

Each part is kept once computed (NOTE: [Derived-document cache] in graphdeck/server/derived.py):
a 1,024-rank run's checks cost seconds each, paid once per state of the run, not per page. A part
that raised (``ERROR``), was cut short by its budget or could not read its evidence is not kept.

Trace coverage maps every rank's trace (~0.13 s CPU each: ~130 s at 1,024 ranks). On the page
it gets :data:`PAGE_TRACES_BUDGET_S`: it answers with the ranks mapped so far (INCOMPLETE, naming
those not mapped yet, never PASS) and the rest are mapped on the server's background thread,
each trace once (the per-trace results kept as the derived document ``tracecov``); once every
rank is mapped the complete answer is kept and the next request gets it. ``graphdeck summary``
keeps its own budget (``BUDGETS_S``)."""

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
from graphdeck.server.derived import cached, in_background, keep_doc, run_fingerprint, running, stored_doc
from graphdeck.store.schema import Run

router = APIRouter(tags=["runs"], route_class=RunPathRoute)

#: Seconds of trace mapping a page's request spends before answering (the rest: background).
PAGE_TRACES_BUDGET_S = 3.0
#: Seconds of mapping between two saves of the background's progress.
BACKGROUND_BATCH_S = 10.0
_memos: dict[tuple, dict] = {}  # (store URL, run id, fingerprint) -> trace id -> coverage


def _keep(doc: dict) -> bool:
    """Whether a part's answer may be kept: not an ERROR, not cut short by its budget (trace
    coverage's rank loop; a check that only ran long is complete and kept), its evidence read
    (``slowest``: not "could not be read")."""
    if doc.get("verdict") == "ERROR":
        return False
    if any("budget was spent" in str(r) for r in doc.get("reasons") or []):
        return False
    return not str(doc.get("reason") or "").startswith("step times could not be read")


def _memo(session: Session, run: Run, fingerprint: str) -> dict:
    key = (str(session.get_bind().url), run.id, fingerprint)
    memo = _memos.get(key)
    if memo is None:
        kept = stored_doc(session, run, "tracecov", fingerprint) or {}
        memo = _memos.setdefault(key, {int(t): v for t, v in kept.items()})
        for old in [k for k in _memos if k[:2] == key[:2] and k != key]:
            _memos.pop(old, None)  # an older state of the run
    return memo


def _finish_traces(app, run_id: int, fingerprint: str) -> None:
    """Map the traces a page's request left, in batches, keeping progress; then keep the whole answer."""
    from sqlalchemy.orm import Session as _Session

    with _Session(app.state.read_engine) as s:
        run = s.get(Run, run_id)
        if run is None or run_fingerprint(s, run) != fingerprint:
            return
        memo = _memo(s, run, fingerprint)
        while True:
            before = len(memo)
            doc = run_check(s, run, "traces", budgets_s={"traces": BACKGROUND_BATCH_S}, memo=memo)
            keep_doc(s, run, "tracecov", dict(memo), app.state.engine, fingerprint)
            if _keep(doc):
                keep_doc(s, run, "summary:traces", doc, app.state.engine, fingerprint)
                return
            if len(memo) == before or doc.get("verdict") == "ERROR":
                return  # no progress: the next request tries again


def _traces_part(request: Request, session: Session, run: Run) -> dict:
    fingerprint = run_fingerprint(session, run)
    done = stored_doc(session, run, "summary:traces", fingerprint)
    if done is not None:
        return {**done, "cache": "store"}
    memo = _memo(session, run, fingerprint)
    job = (str(session.get_bind().url), run.id, fingerprint)
    # While the background maps this run, a request only reports its progress (no trace mapped twice).
    budget = 0.0 if running(job) else PAGE_TRACES_BUDGET_S
    doc = run_check(session, run, "traces", budgets_s={"traces": budget}, memo=memo)
    if budget == 0.0:  # a progress report is not "over" a budget it was never given
        doc = {**doc, "over_budget": False, "budget_s": PAGE_TRACES_BUDGET_S,
               "reasons": [r for r in doc.get("reasons", []) if not str(r).startswith("took ")]}
    if _keep(doc):
        keep_doc(session, run, "summary:traces", doc, request.app.state.engine, fingerprint, doc.get("elapsed_s", 0))
        return {**doc, "cache": "computed"}
    keep_doc(session, run, "tracecov", dict(memo), request.app.state.engine, fingerprint)
    in_background(job, lambda: _finish_traces(request.app, run.id, fingerprint))
    mapped = sum(1 for d in (doc.get("detail") or {}).get("ranks") or [])
    doc = {**doc, "cache": "computed", "continuing": True,
           "reasons": [*doc.get("reasons", []), f"{mapped} rank(s) mapped so far; the rest are being mapped on the "
                       "server in the background (each trace once): reload for the complete answer"]}
    return doc


def summary_part(request: Request, session: Session, run: Run, part: str) -> dict:
    """One part (a check of ``CHECKS`` or ``slowest``) from the derived-document cache or computed
    now; ``cache`` says which (``memory`` | ``store`` | ``computed``). Raises BadInputError (400)
    for another part."""
    if part not in PARTS:
        raise BadInputError(f"unknown overview part {part!r}: use one of {', '.join(PARTS)}")
    if part == "traces":
        return _traces_part(request, session, run)
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
    (median step ns) from the traces, with the straggler when ranks were matched. Trace coverage
    as on the page: :data:`PAGE_TRACES_BUDGET_S` of mapping, the rest in the background
    (``continuing``). 404 for an unknown run."""
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
