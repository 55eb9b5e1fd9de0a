"""Documents derived from a run (an overview check's line, the slowest steps, a rank heatmap) kept
once computed, so a large run's page answers from them (issue 26 item 2).

# NOTE: [Derived-document cache]
At 1,024 ranks the overview's checks cost seconds of CPU each (``gradients`` ~6–10 s,
``ranks`` ~2–3 s, reading ~2 GB of store), and the rank heatmap's matching ~0.2–0.5 s: paid on
every page, by every server process. Each document is kept twice:

* in memory, per process (the last :data:`MEMORY_DOCS` documents);
* in the store, as one ``store_meta`` row per document (key ``derived:<run id>:<part>``, at most
  64 characters; value ``{"v", "fingerprint", "doc", "elapsed_s"}`` as JSON) — the table the
  upload routes already keep their own records in; no schema change. A fresh server process (or
  another one serving the same store) answers from it.

A document is valid while the run's **fingerprint** is the one it was computed against: per
table the check readers read (ranks, params, graphs, partitions, compile records, gradient steps,
kernel links) the run's row count and largest id; its traces (count, smallest and largest id,
events, earliest start, latest end, how many are ok / truncated / ingesting); the run's name,
world size and metadata; and :data:`VERSION` (bumped when a derived document's shape or meaning
changes). A row added, a trace re-ingested or deleted, a run renamed... is another
fingerprint; an in-place edit of a row that keeps its id and the counts (no writer of graphdeck
does that to these tables) would not be seen. Computing the fingerprint is two statements of
indexed aggregates (~10–20 ms at 1,024 ranks).

Writes: GET routes read through the read-only engine (``server/deps.py``); the store row is
written afterwards through the app's one writer (``app.state.engine``), on a single background
thread, so a response never waits for SQLite's write lock. A failed write (a read-only file, a
locked store) is logged and the document is answered anyway — the cache is an optimisation,
never a source of truth: an unreadable or stale row is recomputed. Concurrent requests for the
same document compute it once (the others wait for it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import case, func, literal, select, union_all
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from graphdeck.store.schema import (
    CompileEvent,
    GradStep,
    Graph,
    KernelNode,
    Param,
    Partition,
    Rank,
    Run,
    StoreMeta,
    Trace,
)

log = logging.getLogger(__name__)

#: Bumped when a derived document's shape or meaning changes: older rows are recomputed.
VERSION = 3  # 2: rank lists as ranges, alike ranks one line, hang numbering named (issue 26); 3: trace coverage of compiled graphs only (NOTE: [Trace coverage])
#: Documents kept in memory per process.
MEMORY_DOCS = 64
_KEY_MAX = 64  # store_meta.key is String(64)

_memory: OrderedDict = OrderedDict()
_lock = threading.Lock()
_inflight: dict[tuple, threading.Lock] = {}
_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="derived-cache")


def run_fingerprint(session: Session, run: Run) -> str:
    """The run's state as a short hex digest (NOTE: [Derived-document cache]): what each derived
    document was computed against. One statement (a UNION ALL of per-table aggregates)."""
    parts = [select(literal(i).label("t"), func.count().label("n"), func.max(model.id).label("hi"),
                    literal(0).label("a"), literal(0).label("b"), literal(0).label("c"))
             .where(model.run_id == run.id)
             for i, model in enumerate((Rank, Param, Graph, Partition, CompileEvent, GradStep, KernelNode))]
    rows = sorted(tuple(r) for r in session.execute(union_all(*parts)).all())
    # The traces in one pass (their rows are wide: a scan per status would read them five times).
    n = lambda st: func.coalesce(func.sum(case((Trace.status == st, 1), else_=0)), 0)  # noqa: E731
    traces = tuple(session.execute(select(
        func.count(), func.min(Trace.id), func.max(Trace.id), func.sum(Trace.num_events), func.min(Trace.start_ns),
        func.max(Trace.end_ns), n("ok"), n("truncated"), n("ingesting")).where(Trace.run_id == run.id)).one())
    head = [VERSION, run.id, run.name, run.world_size, run.meta_json]
    return hashlib.sha1(json.dumps([head, rows, traces], default=str).encode()).hexdigest()


def store_key(run_id: int, part: str) -> str:
    """``derived:<run id>:<part>``. Raises ValueError past 64 characters (``store_meta.key``)."""
    key = f"derived:{run_id}:{part}"
    if len(key) > _KEY_MAX:
        raise ValueError(f"derived-document key too long for store_meta: {key!r}")
    return key


def _read_stored(session: Session, key: str, fingerprint: str) -> dict | None:
    try:
        raw = session.scalar(select(StoreMeta.value).where(StoreMeta.key == key))
        if not raw:
            return None
        row = json.loads(raw)
        if isinstance(row, dict) and row.get("v") == VERSION and row.get("fingerprint") == fingerprint:
            return row.get("doc")
    except Exception:  # noqa: BLE001 - an unreadable row is recomputed, never trusted
        log.debug("derived cache: row %s unreadable", key, exc_info=True)
        session.rollback()
    return None


def _write_stored(engine: Engine, key: str, fingerprint: str, doc: dict, elapsed_s: float) -> None:
    value = json.dumps({"v": VERSION, "fingerprint": fingerprint, "doc": doc, "elapsed_s": round(elapsed_s, 3)},
                       default=str)
    try:
        with Session(engine) as s, s.begin():
            row = s.get(StoreMeta, key)
            if row is None:
                s.add(StoreMeta(key=key, value=value))
            else:
                row.value = value
    except Exception:  # noqa: BLE001 - the cache is an optimisation: the answer was given anyway
        log.warning("derived cache: could not keep %s in the store", key, exc_info=True)


def _submit_write(engine: Engine, key: str, fingerprint: str, doc: dict, elapsed_s: float) -> None:
    try:
        _writer.submit(_write_stored, engine, key, fingerprint, doc, elapsed_s)
    except RuntimeError:  # the interpreter is shutting down (a background job's last save): write now
        _write_stored(engine, key, fingerprint, doc, elapsed_s)


def _keys(session: Session, run: Run, part: str, fingerprint: str) -> tuple[str, tuple]:
    """``(store key, memory key)`` of ``(run, part)`` in the state ``fingerprint``: the
    ``store_meta`` key, and that key with the store's URL and the fingerprint."""
    key = store_key(run.id, part)
    return key, (str(session.get_bind().url), key, fingerprint)


def _remember(mem_key: tuple, doc: dict) -> None:
    """Keep ``doc`` in this process's memory (the last :data:`MEMORY_DOCS` documents)."""
    with _lock:
        _memory[mem_key] = doc
        while len(_memory) > MEMORY_DOCS:
            _memory.popitem(last=False)


def cached(session: Session, run: Run, part: str, compute: Callable[[], dict],
           writer: Engine | None = None, keep: Callable[[dict], bool] | None = None) -> tuple[dict, str]:
    """``compute()``'s document for ``(run, part)``, from memory, the store, or computed now and
    kept (NOTE: [Derived-document cache]). ``part``: a short name of the document and its
    parameters (``check:ranks``, ``heatmap:lateness:steps:256``). ``writer``: the engine that
    may write ``store_meta`` (None: memory only). ``keep(doc)`` False: the document is answered
    but not kept (an error, an answer cut short by a time budget). Returns ``(doc, source)``, ``source`` one of
    ``memory`` | ``store`` | ``computed``. Exceptions of ``compute`` propagate (nothing kept)."""
    fingerprint = run_fingerprint(session, run)
    key, mem_key = _keys(session, run, part, fingerprint)
    with _lock:
        hit = _memory.get(mem_key)
        if hit is not None:
            _memory.move_to_end(mem_key)
            return hit, "memory"
        gate = _inflight.setdefault(mem_key, threading.Lock())
    with gate:  # one computation per document; the others wait for it, then read memory
        try:
            with _lock:
                hit = _memory.get(mem_key)
            if hit is not None:
                return hit, "memory"
            doc, source = _read_stored(session, key, fingerprint), "store"
            if doc is None:
                t0 = time.perf_counter()
                doc, source = compute(), "computed"
                if keep is not None and not keep(doc):
                    return doc, source
                if writer is not None:
                    _submit_write(writer, key, fingerprint, doc, time.perf_counter() - t0)
            _remember(mem_key, doc)
        finally:
            with _lock:
                if _inflight.get(mem_key) is gate:
                    del _inflight[mem_key]
    return doc, source


def stored_doc(session: Session, run: Run, part: str, fingerprint: str | None = None) -> dict | None:
    """The kept document of ``(run, part)`` valid for the run's state (memory, else the store),
    or None. ``fingerprint``: :func:`run_fingerprint`'s, when the caller has it."""
    fingerprint = fingerprint or run_fingerprint(session, run)
    key, mem_key = _keys(session, run, part, fingerprint)
    with _lock:
        hit = _memory.get(mem_key)
    if hit is not None:
        return hit
    hit = _read_stored(session, key, fingerprint)
    if hit is not None:
        _remember(mem_key, hit)
    return hit


def keep_doc(session: Session, run: Run, part: str, doc: dict, writer: Engine | None,
             fingerprint: str | None = None, elapsed_s: float = 0.0) -> None:
    """Keep ``doc`` as ``(run, part)``'s document for the run's state: in memory, and in the
    store through ``writer`` (on the writer thread)."""
    fingerprint = fingerprint or run_fingerprint(session, run)
    key, mem_key = _keys(session, run, part, fingerprint)
    _remember(mem_key, doc)
    if writer is not None:
        _submit_write(writer, key, fingerprint, doc, elapsed_s)


_background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="derived-background")
_queued: set = set()


def in_background(key: tuple, fn: Callable[[], None]) -> bool:
    """Run ``fn`` on the one background thread unless a job of ``key`` is queued or running;
    True when queued now. Its exceptions are logged."""
    with _lock:
        if key in _queued:
            return False
        _queued.add(key)

    def job() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a background computation only ever fills the cache
            log.warning("derived cache: background job %s failed", key, exc_info=True)
        finally:
            with _lock:
                _queued.discard(key)

    _background.submit(job)
    return True


def running(key: tuple) -> bool:
    """Whether a background job of ``key`` is queued or running."""
    with _lock:
        return key in _queued


def flush(timeout_s: float = 10.0) -> None:
    """Wait until the store writes queued so far are done (tests, benchmarks)."""
    _writer.submit(lambda: None).result(timeout=timeout_s)


def clear_memory() -> None:
    """Forget the in-memory documents (a benchmark's "fresh process" without a new process)."""
    with _lock:
        _memory.clear()
