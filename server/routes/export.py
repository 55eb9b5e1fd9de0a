"""Download a run as one Chrome-trace file for Perfetto (NOTE: [Trace export] in
graphdeck/analysis/traces/export.py).

* ``GET /api/runs/{run_id}/export-trace?ranks=0,2-5&gzip=true``: the chosen ranks (default all)
  as one Chrome Trace Event Format JSON, clocks aligned, streamed (rank by rank, never the whole
  run in memory) as ``<run>.trace.json.gz`` (``gzip=false``: ``<run>.trace.json``), with
  ``Content-Disposition: attachment``. A bad ``ranks`` (not a list of ranks and ranges, or ranks
  without a trace) is a 400 naming them; an unknown run, or one without a trace, a 404. The
  ranks, offsets and collective matching are worked out before the first byte is sent, so
  those errors are answered as JSON, never as a cut download.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import CommRule
from graphdeck.analysis.traces.export import ExportPlan, iter_export, plan_export
from graphdeck.errors import UsageError
from graphdeck.server.deps import RunPathRoute, get_session, resolve_run
from graphdeck.store.schema import Run

router = APIRouter(tags=["traces"], route_class=RunPathRoute)


def comm_rule(comm: list[str] | None) -> CommRule:
    """The ``comm`` query patterns as a :class:`CommRule`; :class:`UsageError` (HTTP 400) when one
    is not a regular expression. The export and the replay routes share it."""
    for p in comm or ():
        try:
            re.compile(p)
        except re.error as exc:
            raise UsageError(f"comm pattern {p!r} is not a regular expression: {exc}") from exc
    return CommRule(extra=tuple(comm or ()))


def _stream(engine, plan: ExportPlan, rule: CommRule, gzip: bool) -> Iterator[bytes]:
    """The file's bytes, read through a session of its own (the request's ends with the handler)."""
    comp = zlib.compressobj(3, zlib.DEFLATED, 31) if gzip else None
    with Session(engine) as session:
        for chunk in iter_export(session, plan, rule):
            if comp is None:
                yield chunk
            elif out := comp.compress(chunk):
                yield out
    if comp is not None:
        yield comp.flush()


@router.get("/api/runs/{run_id}/export-trace")
def get_export_trace(request: Request,
                     ranks: str | None = Query(None, description="all (default), or ranks and ranges: 0,2-5"),
                     gzip: bool = Query(True, description="gzip the file (.json.gz; Perfetto opens both)"),
                     comm: list[str] | None = Query(None, description="extra communication-kernel patterns (regex)"),
                     run: Run = Depends(resolve_run), session: Session = Depends(get_session)) -> StreamingResponse:
    """The run's chosen ranks as one Chrome-trace JSON (clock-aligned, one process per rank, FX
    node names in kernel args, collectives linked by flows), streamed as a download."""
    rule = comm_rule(comm)
    plan = plan_export(session, run.id, ranks, rule)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", run.name).strip(".") or f"run{run.id}"
    filename = f"{name}.trace.json" + (".gz" if gzip else "")
    return StreamingResponse(
        _stream(request.app.state.read_engine, plan, rule, gzip),
        media_type="application/gzip" if gzip else "application/json",
        headers={"Content-Disposition": f'attachment; filename="{filename}"',
                 "X-Graphdeck-Ranks": ",".join(map(str, plan.ranks))})
