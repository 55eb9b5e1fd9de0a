"""Run B against run A of the same store (issue 21 item 2; NOTE: [Run diff] in
graphdeck/analysis/diff/runs.py). The dashboard's ``#/diff?a=…&b=…`` page reads it."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from graphdeck.analysis.diff.runs import Gates, diff_runs
from graphdeck.analysis.diff.times import DEFAULT_K, DEFAULT_MIN_NS
from graphdeck.errors import UsageError
from graphdeck.server.deps import find_run, get_session

router = APIRouter(tags=["diff"])


@router.get("/api/diff")
def get_diff(session: Session = Depends(get_session),
             run_a: str = Query(..., min_length=1, max_length=200, description="run A (baseline): id or name"),
             run_b: str = Query(..., min_length=1, max_length=200, description="run B: id or name"),
             max_new_graph_breaks: int | None = Query(None, ge=0, le=10**9, description="gate: new user-code breaks"),
             max_new_recompiles: int | None = Query(None, ge=0, le=10**9, description="gate: added recompiles"),
             max_node_regression_pct: float | None = Query(None, ge=0, le=1e9, description="gate: node/module slower by %"),
             max_peak_memory_increase_pct: float | None = Query(None, ge=0, le=1e9, description="gate: step peak +%"),
             fail_on_new_divergence: bool = Query(False, description="gate: a new rank divergence"),
             fail_on_new_grad_findings: bool = Query(False, description="gate: a new gradient finding"),
             noise_k: float = Query(DEFAULT_K, ge=0, le=1e6, description="noise floor: k x step-to-step spread"),
             min_regression_ns: int = Query(DEFAULT_MIN_NS, ge=0, le=10**15, description="noise floor: minimum ns")) -> dict:
    """``verdict`` (PASS / FAIL / INCOMPLETE), ``failures`` (gates passed), ``sections`` (each
    section's ``status``: compared / INCOMPLETE, and why), ``findings`` (each: ``id``, ``kind``,
    ``message``, ``ranks``, ``links`` [{"a": graph id of run A, "b": graph id of run B, "node_a",
    "node_b"}], ``detail``, ``follows_from``), ``roots`` (ids of the findings nothing explains),
    ``improvements``, ``graphs`` (join counts per rank), ``timing`` (per rank: trace ids, steps,
    top node rows and module rows in ns per step), ``memory`` (per rank, bytes). 404 for an
    unknown run; 400 when both name the same run; 422 for a negative threshold."""
    a, b = find_run(session, run_a), find_run(session, run_b)
    if a.id == b.id:
        raise UsageError(f"run_a and run_b are the same run ({a.name!r}): nothing to compare")
    gates = Gates(max_new_graph_breaks=max_new_graph_breaks, max_new_recompiles=max_new_recompiles,
                  max_node_regression_pct=max_node_regression_pct,
                  max_peak_memory_increase_pct=max_peak_memory_increase_pct,
                  fail_on_new_divergence=fail_on_new_divergence, fail_on_new_grad_findings=fail_on_new_grad_findings,
                  noise_k=noise_k, min_regression_ns=min_regression_ns)
    return diff_runs(session, a, session, b, gates).to_dict()
