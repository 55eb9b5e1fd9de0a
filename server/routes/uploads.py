"""Resumable, idempotent uploads of a Kineto trace or a capture bundle (a rank's SQLite store).

* ``POST /api/uploads`` JSON ``{"kind": "trace"|"bundle", "run", "rank", "size_bytes",
  "sha256", "chunk_bytes", "name"?, "strict"?}`` → 201 (200 when it already existed) with the
  upload's status (below). The id is derived from the spec, so a client that restarts and
  declares the same file gets the same upload back, with its chunks. When this server's store
  already holds the upload the answer is ``state: done`` with the stored result
  (``already_merged: true``) and no chunk needs sending; "done" is only ever what the store
  records (NOTE: [Store is the truth] in :func:`_reconcile`).
* ``PUT /api/uploads/{id}/chunks/{index}`` raw body, header ``X-Chunk-Sha256: <hex>``: chunk
  ``index`` covers bytes ``[index*chunk_bytes, min((index+1)*chunk_bytes, size_bytes))``.
  201 stored, 200 ``{"stored": false}`` when it was already there (a retry stores nothing),
  409 when it is there with other bytes, 413 when longer than the chunk, 400 on a checksum or
  length mismatch.
* ``GET /api/uploads/{id}``: ``{"id", "kind", "run", "rank", "size_bytes", "sha256",
  "chunk_bytes", "num_chunks", "present", "missing", "received_bytes", "state", "result",
  "error"}`` — a client resumes by sending ``missing``.
* ``POST /api/uploads/{id}/complete``: checks every chunk is there (409 with ``missing``) and the
  whole sha256 (400), checks gzip inflation against the caps (413), then ingests and answers
  ``{"ok": true, "upload": status}`` with ``status["result"]``. A trace is ingested by
  :func:`~graphdeck.store.traces.ingest_trace` into a private staging store first; then the
  staged run (trace) or the bundle is merged into the server's store by
  :func:`~graphdeck.store.merge.merge_store` in ONE transaction that also records
  ``store_meta["upload:<id>"]``: no half-ingested trace or half-merged bundle is ever visible,
  and completing twice (or again after a crash) ingests once.
* ``GET /api/health``: ``{"ok": true}`` (always readable; for healthchecks).

Merges run one at a time (one writer thread in the server), so concurrent uploads never meet
SQLite's ``database is locked``; other processes writing the same SQLite file are waited for
(``busy_timeout``) and a merge still locked out is retried with backoff.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path as FsPath
from typing import Literal

from fastapi import APIRouter, Depends, Header, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError, field_validator
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool

from graphdeck.errors import (
    BadInputError,
    ConflictError,
    GraphdeckError,
    PayloadTooLargeError,
    StoreError,
    StoreFullError,
)
from graphdeck.server.deps import get_engine, get_settings
from graphdeck.server.upload_area import (
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    DepthScan,
    UploadArea,
    UploadSpec,
    check_json_depth,
    default_data_dir,
    inflate_checked,
    is_gzip,
)
from graphdeck.store.schema import StoreMeta

router = APIRouter(tags=["uploads"])
UPLOAD_ID_PATTERN = r"^[0-9a-f]{32}$"
MERGE_LOCK_RETRIES = 8
#: Creating or migrating a store runs Alembic, whose command context is process-global (two
#: threads at once: ``KeyError: 'config'``): one at a time in this server.
OPEN_STORE_LOCK = threading.Lock()


class UploadRequest(BaseModel):
    kind: Literal["trace", "bundle"]
    run: str = Field(min_length=1, max_length=200, description="target run name (any text; never a path)")
    rank: int | None = Field(None, ge=0, le=1_000_000)
    size_bytes: int = Field(ge=1, description="total bytes of the file as sent (gzip or not)")
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$", description="sha256 of the whole file, hex")
    chunk_bytes: int = Field(8 * 1024 * 1024, ge=1, le=MAX_CHUNK_BYTES)
    name: str | None = Field(None, max_length=300, description="display name (e.g. the trace's file name)")
    strict: bool = False

    @field_validator("run", "name")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("must not contain a NUL character")
        return value


def get_area(request: Request) -> UploadArea:
    """The app's :class:`UploadArea`, created on first use under ``settings.data_dir``."""
    state = request.app.state
    area = getattr(state, "upload_area", None)
    if area is None:
        with _CREATE_LOCK:
            area = getattr(state, "upload_area", None)
            if area is None:
                area = state.upload_area = UploadArea(data_dir_for(state.settings))
                state.merge_lock = threading.Lock()
    return area


_CREATE_LOCK = threading.Lock()


def data_dir_for(settings) -> FsPath:
    """``settings.data_dir``, else ``<store>.uploads`` beside a SQLite store file, else
    :func:`~graphdeck.server.upload_area.default_data_dir` of the store URL (named by a hash of
    the URL without its password, so two servers on two databases never share an upload folder;
    :class:`~graphdeck.server.settings.Settings` already fills ``data_dir`` with it)."""
    if getattr(settings, "data_dir", None):
        return FsPath(settings.data_dir)
    store = str(settings.store)
    if "://" not in store:
        p = FsPath(store).expanduser().resolve()
        return p.with_name(p.name + ".uploads")
    return FsPath(default_data_dir(store))


@router.get("/api/health")
def health() -> dict:
    """Liveness for healthchecks: ``{"ok": true}``."""
    return {"ok": True}


#: Largest upload declaration (JSON) read; a longer body is a 413 before it is parsed.
SPEC_MAX_BYTES = 64 * 1024


async def _read_spec(request: Request) -> UploadRequest:
    """The declaration, read under :data:`SPEC_MAX_BYTES` and parsed by pydantic's own JSON parser
    (depth-limited: 100k ``[`` is a 422, not a recursion error)."""
    length = request.headers.get("content-length")
    too_big = PayloadTooLargeError(f"an upload declaration is at most {SPEC_MAX_BYTES} bytes",
                                   limit_bytes=SPEC_MAX_BYTES)
    if length and length.isdigit() and int(length) > SPEC_MAX_BYTES:
        raise too_big
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > SPEC_MAX_BYTES:
            raise too_big
    try:
        return UploadRequest.model_validate_json(bytes(data))
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]) from None


@router.post("/api/uploads", status_code=201, openapi_extra={"requestBody": {
    "required": True, "content": {"application/json": {"schema": UploadRequest.model_json_schema()}}}})
async def create_upload(request: Request, response: Response, settings=Depends(get_settings),
                        area: UploadArea = Depends(get_area), engine=Depends(get_engine)) -> dict:
    """Open an upload (or find the same one again); see the module docstring."""
    body = await _read_spec(request)
    return await run_in_threadpool(_create, body, response, settings, area, engine)


def _create(body: UploadRequest, response: Response, settings, area: UploadArea, engine) -> dict:
    cap = int(settings.max_upload_bytes)
    if body.size_bytes > cap:
        raise PayloadTooLargeError(f"an upload of {body.size_bytes} bytes is larger than the {cap}-byte limit",
                                   limit_bytes=cap)
    spec = UploadSpec(kind=body.kind, run=body.run, rank=body.rank, size_bytes=body.size_bytes,
                      sha256=body.sha256.lower(), chunk_bytes=min(body.chunk_bytes, body.size_bytes),
                      name=body.name, strict=body.strict)
    if spec.num_chunks > MAX_CHUNKS:
        raise BadInputError(f"{spec.num_chunks} chunks is more than {MAX_CHUNKS}; use larger chunk_bytes")
    _maybe_sweep(area, settings)
    upload_id = spec.upload_id()
    existed = (area.root / upload_id / "meta.json").exists()
    area.create(spec)
    with area.lock(upload_id):
        _reconcile(area, upload_id, engine, reopen_failed=True)
    if existed:
        response.status_code = 200
    return area.status(upload_id)


def _stored_result(engine, upload_id: str) -> dict | None:
    """The store's own record of upload ``upload_id`` (``store_meta["upload:<id>"]``, written in
    the merge's transaction), or None when this store never took it."""
    with engine.connect() as conn:
        done = conn.execute(select(StoreMeta.value).where(StoreMeta.key == f"upload:{upload_id}")).scalar()
    return None if done is None else json.loads(done)


def _reconcile(area: UploadArea, upload_id: str, engine, *, reopen_failed: bool) -> None:
    """Make the upload's state in the data dir agree with the store (call with its lock held).

    NOTE: [Store is the truth] The data dir may outlive its store or be shared by several (a
    fresh store beside an old ``GRAPHDECK_DATA_DIR``; ``graphdeck stack`` whose database was
    removed; two servers on one folder), so "done" in ``meta.json`` proves nothing. An upload is
    done exactly when the store holds its marker: then it is answered from that marker
    (``already_merged: true``) without any chunk being sent; a "done" the store does not hold is
    reopened (its chunks were dropped, so the client sends them again). A failure is not kept
    across declarations: declaring the file again (``reopen_failed``) reopens it, so a retry
    after a fix (an upgraded server, a store with room) is attempted again.
    """
    meta = area.meta(upload_id)
    stored = _stored_result(engine, upload_id)
    if stored is not None:
        kind = meta["spec"]["kind"]
        old = meta["result"] if meta["state"] == "done" and meta["result"] else {}
        same = old.get("run_id") == stored.get("run_id")
        area.set_state(upload_id, "done", result={**(old if same else {}), "kind": kind, **stored,
                                                  "already_merged": True})
        area.clean(upload_id)
    elif meta["state"] == "done" or (meta["state"] == "failed" and reopen_failed):
        area.reopen(upload_id)


#: Abandoned uploads are swept at most this often (on an upload's creation).
SWEEP_EVERY_S = 600.0


def _maybe_sweep(area: UploadArea, settings) -> None:
    now = time.monotonic()
    last = getattr(area, "last_sweep", None)
    if last is not None and now - last < SWEEP_EVERY_S:
        return
    area.last_sweep = now
    area.sweep(float(getattr(settings, "upload_ttl_s", 7 * 24 * 3600)))


@router.get("/api/uploads/{upload_id}")
def get_upload(upload_id: str = Path(pattern=UPLOAD_ID_PATTERN), area: UploadArea = Depends(get_area),
               engine=Depends(get_engine)) -> dict:
    """The upload's status: which chunks are present and missing, its state and result ("done"
    only when the store holds the upload: see :func:`_reconcile`)."""
    with area.lock(upload_id):
        _reconcile(area, upload_id, engine, reopen_failed=False)
    return area.status(upload_id)


@router.put("/api/uploads/{upload_id}/chunks/{index}")
async def put_chunk(request: Request, response: Response, upload_id: str = Path(pattern=UPLOAD_ID_PATTERN),
                    index: int = Path(ge=0, lt=MAX_CHUNKS),
                    x_chunk_sha256: str = Header(pattern=r"^[0-9a-fA-F]{64}$",
                                                 description="sha256 of this chunk's bytes, hex"),
                    area: UploadArea = Depends(get_area)) -> dict:
    """Store one chunk (see the module docstring)."""
    spec = area.spec(upload_id)
    expected = spec.chunk_length(index)
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > expected:
        raise PayloadTooLargeError(f"chunk {index} of {length} bytes is larger than its {expected} bytes",
                                   limit_bytes=expected)
    stored = await area.put_chunk(upload_id, index, x_chunk_sha256.lower(), request.stream())
    response.status_code = 201 if stored else 200
    return {"ok": True, "index": index, "stored": stored}


@router.post("/api/uploads/{upload_id}/complete")
def complete_upload(request: Request, upload_id: str = Path(pattern=UPLOAD_ID_PATTERN),
                    area: UploadArea = Depends(get_area), settings=Depends(get_settings),
                    engine=Depends(get_engine)) -> dict:
    """Verify, ingest once, answer the status with its ``result`` (see the module docstring)."""
    with area.lock(upload_id):
        _reconcile(area, upload_id, engine, reopen_failed=False)
        meta = area.meta(upload_id)
        if meta["state"] == "failed":
            err = meta["error"] or {}
            raise _rebuild_error(err)
        if meta["state"] != "done":
            try:
                result = _ingest(area, upload_id, settings, engine, request.app.state.merge_lock)
            except BadInputError as exc:
                if not isinstance(exc, ConflictError):
                    # The file itself is bad: a permanent answer (the chunks are dropped).
                    area.set_state(upload_id, "failed", error={"message": exc.message, "status": exc.status_code,
                                                               "details": _jsonable(exc.details)})
                    area.clean(upload_id)
                raise
            area.set_state(upload_id, "done", result=result)
            area.clean(upload_id)
    return {"ok": True, "upload": area.status(upload_id)}


def _ingest(area: UploadArea, upload_id: str, settings, engine, merge_lock: threading.Lock) -> dict:
    from graphdeck.store.merge import merge_store, prepare_bundle

    spec = area.spec(upload_id)
    marker = f"upload:{upload_id}"
    with engine.connect() as conn:  # merged before a crash that lost the "done" state?
        done = conn.execute(select(StoreMeta.value).where(StoreMeta.key == marker)).scalar()
    if done is not None:
        return {"kind": spec.kind, **json.loads(done), "already_merged": True}
    path = area.assemble(upload_id)
    work = area.work_dir(upload_id)
    caps = {"max_bytes": settings.max_decompressed_bytes, "max_ratio": settings.max_decompress_ratio}
    if spec.kind == "bundle":
        source = path
        if is_gzip(path):
            source = work / "bundle.db"
            inflate_checked(path, into=source, **caps)
        with OPEN_STORE_LOCK:
            prepare_bundle(source)  # a private copy: triggers/views dropped, older schema upgraded
        merged = _merge_serialised(merge_store, source, engine, spec.run, marker, merge_lock)
        return {"kind": "bundle", **merged}
    if is_gzip(path):  # counted, not kept: ingest_trace reads the gzip itself
        inflate_checked(path, sink=DepthScan(), **caps)
    else:
        with open(path, "rb") as f:
            check_json_depth(f)
    staged, trace = _stage_trace(path, work, spec)
    merged = _merge_serialised(merge_store, staged, engine, spec.run, marker, merge_lock)
    trace_ids = merged.get("created", {}).get("traces") or []
    return {"kind": "trace", **merged, "trace_id": trace_ids[0] if trace_ids else None, **trace}


def _stage_trace(path: FsPath, work: FsPath, spec: UploadSpec) -> tuple[FsPath, dict]:
    """Ingest the trace into a fresh SQLite store in ``work``; a truncated trace (not strict) is
    kept as ``status: truncated``, as ``POST /api/runs/{run}/traces`` does."""
    from graphdeck.errors import TruncatedInputError
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    staged = work / "stage.db"
    for suffix in ("", "-wal", "-shm"):
        FsPath(f"{staged}{suffix}").unlink(missing_ok=True)
    with OPEN_STORE_LOCK:
        stage_engine = open_engine(staged)
    try:
        with open(path, "rb") as fh:
            try:
                r = ingest_trace(stage_engine, fh, run_name=spec.run, rank=spec.rank,
                                 name=spec.name or "uploaded trace", strict=spec.strict)
                info = {"rank": r.rank, "status": r.status, "num_events": r.num_events, "stats": r.stats}
            except RecursionError as exc:  # defence in depth: nesting under the depth check's radar
                raise BadInputError("the trace nests too deeply to be read") from exc
            except TruncatedInputError as exc:
                if not exc.details.get("kept"):
                    raise
                info = {"rank": spec.rank, "status": "truncated", "num_events": exc.details.get("num_events"),
                        "stats": exc.details.get("stats"), "warning": exc.message}
    finally:
        stage_engine.dispose()
    return staged, info


def _merge_serialised(merge_store, source, engine, run_name: str, marker: str, lock: threading.Lock) -> dict:
    """One merge at a time in this server; a SQLite lock held by another process past
    ``busy_timeout`` is retried with backoff; a full disk becomes 507."""
    for attempt in range(MERGE_LOCK_RETRIES):
        try:
            with lock:
                return merge_store(source, engine, run_name=run_name, marker_key=marker)
        except OperationalError as exc:
            text = str(exc.orig if exc.orig is not None else exc).lower()
            if "full" in text or "disk i/o" in text:
                raise StoreFullError(f"the store could not take the upload ({text[:200]}); nothing of it was "
                                     "kept") from exc
            if "locked" not in text and "busy" not in text or attempt == MERGE_LOCK_RETRIES - 1:
                raise StoreError(f"the store could not take the upload: {text[:200]}") from exc
            time.sleep(min(5.0, 0.2 * 2**attempt))
    raise AssertionError("unreachable")


def _rebuild_error(err: dict) -> GraphdeckError:
    exc = BadInputError(err.get("message", "the upload failed"), **(err.get("details") or {}))
    exc.status_code = int(err.get("status", 400))
    return exc


def _jsonable(details: dict) -> dict:
    try:
        json.dumps(details)
        return details
    except (TypeError, ValueError):
        return {k: str(v) for k, v in details.items()}

