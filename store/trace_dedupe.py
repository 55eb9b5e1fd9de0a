"""The same trace file ingested twice: told by a SHA-256 of its bytes, refused or replaced.

A trace's digest (of the file's bytes as given, gzipped or not) is kept in ``Trace.meta_json`` as
``content_sha256``. :func:`graphdeck.store.traces.ingest_trace` looks it up in the run before
reading: by default a second copy is refused (:class:`~graphdeck.errors.ConflictError`, HTTP 409,
naming the trace that holds it); ``duplicate="replace"`` ingests the file again and deletes the
older trace once the new one is stored; ``duplicate="allow"`` keeps both (the old behaviour).
Unseekable streams cannot be hashed before reading and are never deduplicated.
"""

from __future__ import annotations

import hashlib
import json
from typing import BinaryIO

from sqlalchemy import delete, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.errors import ConflictError, UsageError
from graphdeck.store.db import retrying, write_session
from graphdeck.store.schema import Run, Trace, TraceEvent

DUPLICATE_POLICIES = ("refuse", "replace", "allow")


def content_sha256(fh: BinaryIO) -> str | None:
    """Hex SHA-256 of ``fh``'s bytes from its current position to the end, the position restored;
    None when ``fh`` cannot seek."""
    try:
        if not fh.seekable():
            return None
        start = fh.tell()
    except (AttributeError, OSError):
        return None
    digest = hashlib.sha256()
    for chunk in iter(lambda: fh.read(1 << 20), b""):
        digest.update(chunk)
    fh.seek(start)
    return digest.hexdigest()


def same_content(engine: Engine, run_name: str, sha: str) -> tuple[int, int] | None:
    """``(trace id, rank)`` of a finished trace of run ``run_name`` with this digest, else None."""
    with Session(engine) as s:
        rows = s.execute(select(Trace.id, Trace.rank, Trace.meta_json).join(Run, Run.id == Trace.run_id).where(
            Run.name == run_name, Trace.status.in_(("ok", "truncated")),
            Trace.meta_json.contains(sha))).all()
    for tid, rank, meta in rows:
        try:
            if json.loads(meta or "{}").get("content_sha256") == sha:
                return tid, rank
        except ValueError:
            continue
    return None


def check_duplicate(engine: Engine, run_name: str, fh: BinaryIO, policy: str) -> tuple[str | None, int | None]:
    """``(digest, trace id to delete after a successful replace)``; raises
    :class:`ConflictError` when ``policy`` is ``refuse`` and the run holds the same bytes,
    :class:`UsageError` for an unknown policy."""
    if policy not in DUPLICATE_POLICIES:
        raise UsageError(f"duplicate must be one of {', '.join(DUPLICATE_POLICIES)}, got {policy!r}")
    sha = content_sha256(fh)
    if sha is None or policy == "allow":
        return sha, None
    found = same_content(engine, run_name, sha)
    if found is None:
        return sha, None
    if policy == "refuse":
        raise ConflictError(f"run {run_name!r} already holds this trace (same bytes, sha256 {sha[:12]}…) as trace "
                            f"#{found[0]} of rank {found[1]}: not ingested again (replace it with --replace / "
                            "duplicate='replace')", trace_id=found[0], rank=found[1], content_sha256=sha)
    return sha, found[0]


def record_digest(engine: Engine, trace_id: int, sha: str | None, replaced: int | None) -> None:
    """Write the digest into the new trace's meta and delete the trace it replaces."""
    if sha is None:
        return

    def do():
        with write_session(engine) as s:
            trace = s.get(Trace, trace_id)
            if trace is not None:
                meta = json.loads(trace.meta_json or "{}")
                meta["content_sha256"] = sha
                if replaced is not None:
                    meta["replaced_trace"] = replaced
                trace.meta_json = json.dumps(meta)
            if replaced is not None and replaced != trace_id:
                s.execute(delete(TraceEvent).where(TraceEvent.trace_id == replaced))
                s.execute(delete(Trace).where(Trace.id == replaced))

    retrying(do)
