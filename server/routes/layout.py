"""The parallel layout of a run (issue 20): device meshes, DTensor placements, FSDP2 groups,
pipeline stages, and which ranks must agree (NOTE: [Parallel layout] in
graphdeck/analysis/parallel/layout.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from sqlalchemy.orm import Session

from graphdeck.analysis.parallel.layout import load_layout
from graphdeck.errors import NotFoundError
from graphdeck.server.deps import get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["layout"])


@router.get("/api/runs/{run_id}/layout")
def run_layout(run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> dict:
    """The run's merged parallel layout: ``world_size``, ``ranks`` with a record and
    ``missing_ranks`` without one, ``meshes`` (shape, dim names, nested global ranks), per rank
    ``coords`` and pipeline ``stages``, ``dim_groups`` per mesh dimension, ``program_peers`` (same
    stage: same program) and ``replica_peers`` (same stage and sharding coordinate: same shapes),
    and each rank's record (``records``: meshes with their dimensions' process groups, DTensor
    parameters with placements and local/global shapes, FSDP2 groups, TP styles, pipeline,
    checkpoint/autocast regions).

    404 when the run does not exist, or when no rank of it recorded a layout (a capture older
    than issue 20, a job without a device mesh, DTensor, FSDP2 or pipeline, or a run imported
    from traces)."""
    layout = load_layout(session, run.id)
    if layout is None:
        raise NotFoundError(f"run {run.name!r} has no parallel layout: no rank recorded a device mesh, "
                            "DTensor parameter, FSDP2 group or pipeline stage (graphdeck_parallel_layout)")
    return layout.to_dict()
