"""Trace routes: a trace's metadata and stats, its Plotly timeline, and trace upload.

* ``GET /api/traces/{trace_id}``: the trace row with ``stats`` and ``meta`` decoded.
* ``GET /api/traces/{trace_id}/backward``: backward time by forward module
  (:func:`~graphdeck.analysis.traces.backward.backward_by_module`: ``backward_ns``,
  ``attributed_ns``, ``rows`` [{``module``, ``backward_ns``, ``backward_ops``, ``ops``,
  ``forward_ops``}], ``unattributed``, ``by``, ``note``; ns).
* ``GET /api/traces/{trace_id}/timeline?limit=20000``: :func:`timeline_figure` of the ``limit``
  longest ``X`` events plus the instants (same cap).
* ``POST /api/runs/{run_name}/traces?rank=N&strict=false``: a multipart upload (field ``file``)
  or a raw body (``?name=`` names it), streamed as it arrives (:func:`receive_multipart`; memory
  is one network read plus the spool's 8 MiB) to a spooled temp file, every byte counted against
  ``settings.max_upload_bytes``: 413 the moment it passes, nothing kept; then
  :func:`~graphdeck.store.traces.ingest_trace`, which reads the file in constant memory. A write
  needs ``X-Graphdeck-Client`` or a non-form body type (:mod:`graphdeck.server.auth`).
  201 ``{"ok": true, "trace_id", "run_id", "rank", "status", "num_events", "stats"}``; a
  truncated trace answers 400 with ``stats``, ``kept`` and (when kept) ``trace_id`` and
  ``num_events``, rendered by the app's one error handler.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO

from fastapi import APIRouter, Depends, Path, Query, Request
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, aliased
from starlette.concurrency import run_in_threadpool

from graphdeck.analysis.graphs.view import loads_json
from graphdeck.errors import BadInputError, NotFoundError, PayloadTooLargeError
from graphdeck.server.deps import get_engine, get_session, get_settings
from graphdeck.server.render.timeline import timeline_figure
from graphdeck.store.schema import InternedString, Run, Trace, TraceEvent
from graphdeck.store.traces import ingest_trace

router = APIRouter(tags=["traces"])

#: Upload bytes kept in memory before the spool moves to a temp file.
SPOOL_MEMORY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_UPLOAD_BYTES = 2 * 1024**3


def resolve_trace(
    trace_id: int = Path(description="A trace's numeric id"),
    session: Session = Depends(get_session),
) -> Trace:
    trace = session.get(Trace, trace_id)
    if trace is None:
        raise NotFoundError(f"trace {trace_id} not found", resource="trace", id=trace_id)
    if trace.status == "ingesting":  # being written, or its writer died: never half a trace
        raise NotFoundError(f"trace {trace_id} is not complete (status 'ingesting': still being written, "
                            "or its writer stopped before the end)", resource="trace", id=trace_id)
    return trace


def trace_summary(trace: Trace, run: Run | None) -> dict:
    """The JSON form of a trace row (what ``GET /api/traces/{id}`` answers)."""
    duration_ms = None
    if trace.start_ns is not None and trace.end_ns is not None:
        duration_ms = round((trace.end_ns - trace.start_ns) / 1e6, 6)
    return {
        "id": trace.id,
        "name": trace.name,
        "run_id": trace.run_id,
        "run_name": run.name if run is not None else None,
        "rank": trace.rank,
        "status": trace.status,
        "num_events": trace.num_events,
        "start_ns": trace.start_ns,
        "end_ns": trace.end_ns,
        "duration_ms": duration_ms,
        "created_at": trace.created_at.isoformat() if trace.created_at else None,
        "stats": {k: v for k, v in loads_json(trace.stats_json, {}).items() if k != "collective_index"},
        "meta": loads_json(trace.meta_json, {}),
    }


@router.get("/api/traces/{trace_id}")
def get_trace(trace: Trace = Depends(resolve_trace), session: Session = Depends(get_session)) -> dict:
    """A trace's metadata (run, rank, status, time span) with its ingest ``stats`` and ``meta``
    (the file's top-level keys and process / thread names)."""
    return trace_summary(trace, session.get(Run, trace.run_id))


@router.get("/api/traces/{trace_id}/backward")
def get_backward(trace: Trace = Depends(resolve_trace), session: Session = Depends(get_session)) -> dict:
    """Backward time of the trace by forward module (NOTE: [Backward by forward module])."""
    from graphdeck.analysis.traces.backward import backward_by_module

    return backward_by_module(session, trace.id).to_dict()


def _events(session: Session, trace_id: int, ph: tuple[str, ...], limit: int, longest: bool) -> list[dict]:
    name, cat = aliased(InternedString), aliased(InternedString)
    order = (TraceEvent.dur_ns.desc(), TraceEvent.id) if longest else (TraceEvent.ts_ns, TraceEvent.id)
    stmt = (
        select(TraceEvent.ph, name.value, cat.value, TraceEvent.ts_ns, TraceEvent.dur_ns, TraceEvent.pid, TraceEvent.tid)
        .join(name, name.id == TraceEvent.name_id)
        .outerjoin(cat, cat.id == TraceEvent.cat_id)
        .where(TraceEvent.trace_id == trace_id, TraceEvent.ph.in_(ph))
        .order_by(*order)
        .limit(limit)
    )
    keys = ("ph", "name", "cat", "ts_ns", "dur_ns", "pid", "tid")
    return [dict(zip(keys, row)) for row in session.execute(stmt)]


@router.get("/api/traces/{trace_id}/timeline")
def get_timeline(
    limit: int = Query(20_000, ge=1, le=200_000, description="Draw at most this many of the longest X events"),
    trace: Trace = Depends(resolve_trace),
    session: Session = Depends(get_session),
) -> dict:
    """The trace as a Plotly figure ``{"data", "layout"}``: one lane per pid/tid split into one
    row per nesting depth, a bar per X event (ms since the trace start); above ``limit`` events
    only the longest are drawn (nested by depth among themselves) and the title says so."""
    total = session.scalar(
        select(func.count()).select_from(TraceEvent).where(TraceEvent.trace_id == trace.id, TraceEvent.ph == "X")
    )
    events = _events(session, trace.id, ("X",), limit, longest=True)
    events += _events(session, trace.id, ("i", "I"), limit, longest=False)
    meta = loads_json(trace.meta_json, {})
    return timeline_figure(
        events,
        start_ns=trace.start_ns,
        title=f"{trace.name} (rank {trace.rank})",
        total_events=total,
        process_labels=meta.get("process_labels") or {},
        thread_names=meta.get("thread_names") or {},
    )


# ---------------------------------------------------------------------------- upload


class UploadBudget:
    """The bytes an upload may still write: :meth:`take` is called before each write and raises
    413 as soon as the total passes ``cap_bytes``, so at most ``cap_bytes`` are ever written."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self.size_bytes = 0

    def take(self, n: int) -> None:
        self.size_bytes += n
        if self.size_bytes > self.cap_bytes:
            raise PayloadTooLargeError(f"upload is larger than the {self.cap_bytes}-byte limit; nothing of it was "
                                       "kept", limit_bytes=self.cap_bytes)


class _Spool:
    """A size-capped spooled temp file the upload streams into (memory up to
    :data:`SPOOL_MEMORY_BYTES`, then an unnamed temp file)."""

    def __init__(self, cap_bytes: int):
        self.budget = UploadBudget(cap_bytes)
        self.file = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)

    @property
    def size_bytes(self) -> int:
        return self.budget.size_bytes

    def write(self, data: bytes) -> None:
        self.budget.take(len(data))
        self.file.write(data)


#: Longest header block of one multipart part (its name, file name and type fit in far less).
MAX_PART_HEADER_BYTES = 16 * 1024


async def receive_multipart(request: Request, budget: UploadBudget, field: str,
                            open_part: Callable[[str | None], BinaryIO], *, max_parts: int | None = 1) -> list[tuple]:
    """Stream the multipart parts named ``field`` of ``request`` as they arrive, each into
    ``open_part(file name)`` (a writable binary file; it may raise to refuse the part), every
    byte counted by ``budget`` before it is written; other parts are skipped, and parts past
    ``max_parts`` (``None``: no limit) too. Memory stays at one network read whatever the size.
    Returns ``[(file name, file), ...]`` in order.

    Raises:
        BadInputError: no boundary, a part header over :data:`MAX_PART_HEADER_BYTES`, no part
            named ``field``.
        PayloadTooLargeError: the parts' bytes passed ``budget`` (the caller drops its files).
    """
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadInputError("multipart upload without a boundary")
    want = field.encode()
    parts: list[tuple] = []
    state: dict[str, Any] = {"field": b"", "value": b"", "headers": {}, "header_bytes": 0, "out": None,
                             "error": None}

    def header_bytes(data, start, end, key):
        state["header_bytes"] += end - start
        if state["header_bytes"] > MAX_PART_HEADER_BYTES:
            state["error"] = state["error"] or BadInputError(
                f"a multipart part's headers are longer than {MAX_PART_HEADER_BYTES} bytes")
            return
        state[key] += data[start:end]

    def on_header_end():
        state["headers"][state["field"].lower()] = state["value"]
        state["field"] = state["value"] = b""

    def on_headers_finished():
        _, disp = parse_options_header(state["headers"].get(b"content-disposition", b""))
        state["headers"], state["header_bytes"], state["out"] = {}, 0, None
        if disp.get(b"name") == want and (max_parts is None or len(parts) < max_parts) and state["error"] is None:
            raw_name = disp.get(b"filename")
            filename = raw_name.decode("utf-8", "replace") if raw_name else None
            state["out"] = open_part(filename)
            parts.append((filename, state["out"]))

    def on_part_data(data, start, end):
        if state["out"] is not None and state["error"] is None:
            try:
                budget.take(end - start)
                state["out"].write(data[start:end])
            except PayloadTooLargeError as exc:
                state["error"] = exc

    parser = MultipartParser(boundary, {
        "on_header_field": lambda d, a, b: header_bytes(d, a, b, "field"),
        "on_header_value": lambda d, a, b: header_bytes(d, a, b, "value"),
        "on_header_end": on_header_end, "on_headers_finished": on_headers_finished, "on_part_data": on_part_data,
    })
    async for chunk in request.stream():
        parser.write(chunk)
        if state["error"] is not None:
            raise state["error"]
    parser.finalize()
    if not parts:
        raise BadInputError(f"the upload has no multipart field named {field!r}")
    return parts


def _check_gzip_bomb(spool: _Spool, settings: Any) -> None:
    """413 when a gzip upload inflates past the settings' caps
    (:func:`graphdeck.server.upload_area.inflate_capped`), 400 when the JSON nests deeper than
    :data:`~graphdeck.server.upload_area.MAX_JSON_DEPTH` (NOTE: [Deep nesting]); corrupt gzip is
    left to the ingest."""
    import zlib

    from graphdeck.server.upload_area import GZIP_MAGIC, DepthScan, check_json_depth, inflate_capped

    spool.file.seek(0)
    if spool.file.read(2) != GZIP_MAGIC:
        spool.file.seek(0)
        check_json_depth(spool.file)
        return
    spool.file.seek(0)
    try:
        inflate_capped(spool.file, DepthScan(), compressed_bytes=spool.size_bytes,
                       max_bytes=settings.max_decompressed_bytes, max_ratio=settings.max_decompress_ratio)
    except zlib.error:
        pass


def _ingest_into_run(engine: Engine, src, *, run_name: str, **kw):
    """:func:`ingest_trace`; a run it created is removed again when the ingest fails empty."""
    from graphdeck.store.db import undo_new_run_on_error

    with undo_new_run_on_error(engine, run_name):
        return ingest_trace(engine, src, run_name=run_name, **kw)


@router.post("/api/runs/{run_name}/traces", status_code=201)
async def upload_trace(
    request: Request,
    run_name: str = Path(description="The run to add the trace to (created if missing)"),
    rank: int | None = Query(None, ge=0, description="Rank, when the trace has no distributedInfo"),
    strict: bool = Query(False, description="Fail, keeping nothing, on any dropped event or truncation"),
    name: str | None = Query(None, description="Trace name for a raw (non-multipart) body"),
    engine: Engine = Depends(get_engine),
    settings: Any = Depends(get_settings),
) -> dict:
    """Upload a Kineto trace (``.json`` or ``.json.gz``) as multipart field ``file`` or as the raw
    body; it is ingested as it would be by ``graphdeck ingest-trace``."""
    cap = int(getattr(settings, "max_upload_bytes", DEFAULT_MAX_UPLOAD_BYTES))
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > cap:
        raise PayloadTooLargeError(f"upload of {length} bytes is larger than the {cap}-byte limit", limit_bytes=cap)
    spool = _Spool(cap)
    try:
        content_type = request.headers.get("content-type", "")
        if content_type.lower().startswith("multipart/"):
            [(filename, _)] = await receive_multipart(request, spool.budget, "file", lambda _name: spool.file)
        else:
            filename = None
            async for chunk in request.stream():
                spool.write(chunk)
        if spool.size_bytes == 0:
            raise BadInputError("the uploaded trace is empty")
        await run_in_threadpool(_check_gzip_bomb, spool, settings)
        spool.file.seek(0)
        result = await run_in_threadpool(
            _ingest_into_run, engine, spool.file, run_name=run_name, rank=rank, name=name or filename, strict=strict
        )
    finally:
        spool.file.close()
    return {
        "ok": True,
        "trace_id": result.trace_id,
        "run_id": result.run_id,
        "rank": result.rank,
        "status": result.status,
        "num_events": result.num_events,
        "stats": result.stats,
    }
