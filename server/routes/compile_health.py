"""Compile health of a run (issue 21 item 1): graph breaks, recompile budgets, eager fallbacks,
restarts, compile time and cache hits per rank (NOTE: [Compile health] in
graphdeck/analysis/compilation/health.py). The run page's "Compile health" panel reads it."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from graphdeck.analysis.compilation.health import Thresholds, compile_health
from graphdeck.server.deps import get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["compile"])


@router.get("/api/runs/{run_id}/compile-health")
def get_compile_health(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                       max_graph_breaks: int | None = Query(None, ge=0, description="gate: distinct user-code breaks"),
                       max_recompiles_per_frame: int | None = Query(None, ge=0, description="gate: recompiles of one frame"),
                       fail_on_eager_fallback: bool = Query(False, description="gate: any eager fallback"),
                       fail_on_ddp_no_overlap: bool = Query(False, description="gate: compiled DDP without overlap")) -> dict:
    """``verdict`` (PASS / WARN / FAIL / INCOMPLETE), ``findings`` (gates passed), ``warnings`` (what
    no gate covers: WARN), ``ddp_overlap`` (compiled DDP without overlap), ``missing_evidence``,
    ``summary`` (counts), ``breaks`` and ``frames`` over all ranks, ``fallbacks``, ``spread``
    (compile seconds and cache hit rates across ranks) and ``ranks`` (each rank's breaks, frame
    budgets, fallbacks, restarts and ``stats``: compiles, compile_s = frame_compile_s (the frames'
    compiles, as the compile index sums them) + bwd_compile_s (backward graphs), cache hit/miss/bypass).
    404 for an unknown run; 422 for a negative threshold."""
    return compile_health(session, run, Thresholds(max_graph_breaks=max_graph_breaks,
                                                   max_recompiles_per_frame=max_recompiles_per_frame,
                                                   fail_on_eager_fallback=fail_on_eager_fallback,
                                                   fail_on_ddp_no_overlap=fail_on_ddp_no_overlap)).to_dict()
