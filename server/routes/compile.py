"""Compile records of a run: torch's structured compile events kept by the capture agent
(``compilation_metrics`` per compiled frame, ``dynamo_graph_break_reason``, ...)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Query
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.server.deps import get_session, resolve_run
from graphdeck.store.schema import CompileEvent, Run

router = APIRouter(tags=["compile"])

#: Fields of ``compilation_metrics`` worth a column in the dashboard.
METRIC_FIELDS = ("co_name", "co_filename", "co_firstlineno", "graph_op_count", "graph_node_count",
                 "entire_frame_compile_time_s", "backend_compile_time_s", "fail_type", "fail_reason",
                 "recompile_reason", "inductor_fx_local_cache_hit_count", "aotautograd_local_cache_hit_count")
PAYLOAD_PREVIEW_CHARS = 4000


@router.get("/api/runs/{run_id}/compile-events")
def compile_events(run: Run = Depends(resolve_run), session: Session = Depends(get_session),
                   rank: int | None = Query(None, description="only this rank"),
                   name: str | None = Query(None, description="only this record kind, e.g. compilation_metrics")) -> list[dict]:
    """Per rank, in arrival order: each frame's compile metrics (the fields in ``METRIC_FIELDS``)
    and each graph-break reason (its text, cut to ``PAYLOAD_PREVIEW_CHARS``)."""
    q = select(CompileEvent).where(CompileEvent.run_id == run.id)
    if rank is not None:
        q = q.where(CompileEvent.rank == rank)
    if name is not None:
        q = q.where(CompileEvent.name == name)
    out = []
    for e in session.scalars(q.order_by(CompileEvent.rank, CompileEvent.id)):
        meta = json.loads(e.metadata_json or "{}")
        body = meta.get(e.name) if isinstance(meta.get(e.name), dict) else {}
        item = {"rank": e.rank, "name": e.name, "compile_id": e.compile_id,
                "fields": {k: body[k] for k in METRIC_FIELDS if body.get(k) is not None}}
        if e.payload:
            item["payload"] = e.payload[:PAYLOAD_PREVIEW_CHARS]
        out.append(item)
    return out
