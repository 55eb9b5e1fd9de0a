"""Reference parity of a sharded run against its unsharded reference (issue 35 item 3; the report
of ``graphdeck parity RUN_A RUN_B``, graphdeck/analysis/gradients/parity.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from graphdeck.analysis.gradients.parity import parity_report
from graphdeck.errors import UsageError
from graphdeck.server.deps import find_run, get_session

router = APIRouter(tags=["gradients"])


@router.get("/api/parity")
def get_parity(session: Session = Depends(get_session),
               run_a: str = Query(..., min_length=1, max_length=200, description="the sharded run: id or name"),
               run_b: str = Query(..., min_length=1, max_length=200, description="the reference run: id or name")) -> dict:
    """The document ``graphdeck parity RUN_A RUN_B --format json`` prints: ``verdict`` (PASS /
    FAIL / INCOMPLETE), ``step``, ``worlds``, ``params`` (each: ``name``, ``status`` MATCH / DIFFER
    / NOT_COMPARED / MISSING, ``diff`` and ``scale`` in the gradient's units, ``placements``,
    ``reason``), ``loss``, ``first_node`` (``name``, ``source``, ``incoming``, ...), ``incomplete``,
    ``notes``, ``fix``, ``tolerance`` per dtype. 404 for an unknown run; 400 when both name the same run."""
    a, b = find_run(session, run_a), find_run(session, run_b)
    if a.id == b.id:
        raise UsageError(f"run_a and run_b are the same run ({a.name!r}): nothing to compare")
    return parity_report(session, a, b).to_dict()
