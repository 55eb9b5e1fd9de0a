"""Opening the store: engines, sessions, string interning, run/rank registration.

A store is a SQLite file (the embedded default: a path, or ``sqlite:///path``) or a PostgreSQL
database (``postgresql+psycopg://user:password@host:5432/dbname``, needs ``graphdeck[postgres]``),
the same schema on both (:mod:`graphdeck.store.schema`), created or migrated on open
(:mod:`graphdeck.store.migrate`).

SQLite runs in WAL mode, so several rank processes can write to it at once (SQLite serialises
writers; ``busy_timeout`` makes each wait instead of failing) while the server reads. On
PostgreSQL, ranks write concurrently; two inserting the same run, rank or interned string at
once is a unique violation for one of them, which :func:`retrying` re-runs (the second run of the
transaction finds the row). Each logical write (a graph with its nodes, a batch of trace events)
is one transaction, so a rank that dies mid-write leaves no half-written graph behind.

A write that fails because the disk is full (SQLite ``SQLITE_FULL``, including the size quota
``max_bytes``; PostgreSQL ``53100 disk_full``) raises :class:`~graphdeck.errors.StoreFullError`
naming the cause; its transaction is rolled back. A statement the database refuses for one of its
values (an integer past 64 bits, a text too long for its column or holding NUL on PostgreSQL)
raises :class:`~graphdeck.errors.BadInputError` (a 400 naming ``table.column`` where it can).

A new SQLite store and its ``-wal`` / ``-shm`` files are created readable by their owner only
(0600). :func:`delete_run` removes a run with every row of it; :func:`sweep_stale_traces` removes
traces whose ingest died (NOTE: [Stale ingests]).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from graphdeck.errors import (
    BadInputError,
    GraphdeckError,
    NotAStoreError,
    NotFoundError,
    StoreError,
    UsageError,
)
from graphdeck.store.lite import (  # noqa: F401 (re-exported: the store's sqlite3-only helpers live there)
    BUSY_TIMEOUT_MS,
    MAX_BYTES_ENV,
    apply_pragmas,
    create_private_file,
    is_bad_value,
    is_disk_full,
    refuse_symlinks,
    store_full_error,
    store_url,
)
from graphdeck.store.schema import InternedString, Rank, Run


def display_url(path_or_url: str | os.PathLike) -> str:
    """The store's URL with any password hidden, for messages and logs."""
    try:
        return make_url(store_url(path_or_url)).render_as_string(hide_password=True)
    except ArgumentError:
        return str(path_or_url)


def is_sqlite(path_or_url: str | os.PathLike) -> bool:
    return store_url(path_or_url).startswith("sqlite")


def _sqlite_pragmas(read_only: bool, max_bytes: int | None):
    def on_connect(dbapi_conn, _record):
        apply_pragmas(dbapi_conn, read_only, max_bytes)

    return on_connect


def _autocommit_driver(dbapi_conn, _record):
    dbapi_conn.isolation_level = None


def _translate_errors(context) -> None:
    """``handle_error`` hook: a disk-full driver error leaves as :class:`StoreFullError`; a value
    the database cannot hold or compare (an integer past 64 bits, PostgreSQL's "value too long",
    NUL in text, out-of-range numbers: SQLSTATE class 22) as :class:`BadInputError` naming the
    table and column when the statement says which, so it answers 400, not 500."""
    exc = context.original_exception
    if is_disk_full(exc):
        raise store_full_error(exc) from exc
    if is_bad_value(exc):
        column = _bad_value_column(context)
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise BadInputError(f"the store cannot hold or compare a value{f' in {column}' if column else ''}: "
                            f"{message}", **({"column": column} if column else {})) from exc


def _bad_value_column(context) -> str:
    """``'table.column'`` of the first parameter of an INSERT, UPDATE or SELECT (its first table)
    that is too long for its column or holds NUL, else ``''`` (the message then is the driver's)."""
    import re

    from graphdeck.store.schema import Base

    statement = getattr(context, "statement", None) or ""
    match = re.match(r"\s*(?:INSERT INTO|UPDATE)\s+\"?(\w+)", statement, re.IGNORECASE) or \
        re.search(r"\bFROM\s+\"?(\w+)", statement, re.IGNORECASE)
    table = Base.metadata.tables.get(match.group(1)) if match else None
    params = getattr(context, "parameters", None)
    if table is None or not params:
        return ""
    rows = params if isinstance(params, (list, tuple)) else [params]
    for row in rows:
        if not isinstance(row, dict):
            continue
        for key, value in row.items():
            name = re.sub(r"(_m\d+|_\d+)$", "", str(key))
            col = table.columns.get(name)
            if col is None or not isinstance(value, str):
                continue
            length = getattr(col.type, "length", None)
            if "\x00" in value or (length and len(value) > length):
                return f"{table.name}.{col.name}"
    return ""


def open_engine(path_or_url: str | os.PathLike, *, read_only: bool = False, create: bool = True,
                max_bytes: int | None = None) -> Engine:
    """Open (and, unless ``read_only``, create or migrate) the store at ``path_or_url``.

    Args:
        path_or_url: a SQLite file path, or a SQLAlchemy URL (``sqlite:///...``,
            ``postgresql+psycopg://...``; ``postgresql://`` means psycopg too).
        read_only: SQLite ``PRAGMA query_only``; PostgreSQL ``default_transaction_read_only``.
            Never creates or migrates.
        create: a writer creates the schema in an empty store (else :class:`StoreError`).
        max_bytes: SQLite only: a size quota (default ``$GRAPHDECK_STORE_MAX_BYTES``); writes
            past it raise :class:`StoreFullError`.

    Raises:
        NotFoundError: the SQLite file is missing while ``read_only`` (CLI exit 2).
        UsageError: a URL of an unsupported database.
        StoreError: cannot connect, not a graphdeck store, or psycopg is not installed.
        SchemaVersionError: the store's schema is newer than this graphdeck's (or, read-only,
            older and not migrated yet); the message names both versions.
    """
    from graphdeck.store import migrate

    url = store_url(path_or_url)
    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError as exc:
        raise UsageError(f"not a store path or URL: {display_url(path_or_url)!r} ({exc})") from exc
    if backend == "sqlite":
        engine = _sqlite_engine(url, read_only, max_bytes)
    elif backend == "postgresql":
        engine = _postgres_engine(url, read_only)
    else:
        raise UsageError(f"unsupported store {display_url(url)}: use a SQLite path or postgresql+psycopg://")
    event.listen(engine, "handle_error", _translate_errors)
    try:
        if read_only:
            with engine.connect() as conn:
                migrate.check(conn)
        else:
            migrate.prepare(engine, create=create)
    except GraphdeckError:
        engine.dispose()
        raise
    except (OperationalError, DBAPIError) as exc:
        engine.dispose()
        reason = str(exc.orig)
        if any(m in reason for m in _NOT_A_STORE):  # SQLite's words for a file that is no database
            raise NotAStoreError(f"not a graphdeck store: {display_url(url)}: {reason}") from exc
        raise StoreError(f"cannot open store {display_url(url)}: {reason}") from exc
    return engine


# sqlite3's messages (sqlite3.c: SQLITE_NOTADB, SQLITE_CANTOPEN) for a path that holds no database.
_NOT_A_STORE = ("file is not a database", "unable to open database file")


def _sqlite_engine(url: str, read_only: bool, max_bytes: int | None) -> Engine:
    path = url.split("sqlite:///", 1)[1] if url.startswith("sqlite:///") else ""
    if path and path != ":memory:" and not path.startswith("file:") and "?" not in path:
        refuse_symlinks(path)
    if not read_only and path and path != ":memory:" and not path.startswith("file:") and "?" not in path:
        try:
            create_private_file(path)
        except OSError:
            pass  # a folder that does not exist: SQLite's own open says so
    if read_only:
        path = url.split("sqlite:///", 1)[1]
        if not Path(path).exists():
            raise NotFoundError(f"store {path} does not exist; run a captured job or `graphdeck demo` first",
                                resource="store", id=path)
    if max_bytes is None and os.environ.get(MAX_BYTES_ENV):
        max_bytes = int(os.environ[MAX_BYTES_ENV])
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
    event.listen(engine, "connect", _sqlite_pragmas(read_only, max_bytes))
    if not read_only:
        # NOTE: [Immediate transactions] pysqlite defers BEGIN until the first write, so two
        # ranks can both read "no such run" and then both insert it. We take the write lock
        # at BEGIN instead (SQLAlchemy's documented pysqlite recipe), which serialises
        # read-then-write transactions across processes; busy_timeout makes others wait.
        event.listen(engine, "connect", _autocommit_driver)
        event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return engine


def _postgres_engine(url: str, read_only: bool) -> Engine:
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        raise StoreError("a PostgreSQL store needs psycopg: pip install 'graphdeck[postgres]'") from exc
    connect_args = {"connect_timeout": 10}
    if read_only:
        connect_args["options"] = "-c default_transaction_read_only=on"
    return create_engine(url, connect_args=connect_args, pool_pre_ping=True)


def session_factory(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)


#: Write transactions open on the main thread now, and what to call once none is: a signal
#: handler (Python runs it on the main thread, between two bytecodes, perhaps inside one of them)
#: must not start another write that waits for the lock the interrupted one holds (NOTE: [A SIGTERM
#: during a dump] in ``capture/flight.py``).
_MAIN_WRITES = [0]
_AFTER_MAIN_WRITES: list = []


def main_thread_writing() -> bool:
    """Whether the main thread is inside :func:`write_session` (or :func:`main_thread_section`) now."""
    return _MAIN_WRITES[0] > 0


def after_main_writes(fn) -> None:
    """Call ``fn()`` once the main thread's open write transactions have ended (committed or not)."""
    _AFTER_MAIN_WRITES.append(fn)


_MAIN_IDENT = threading.main_thread().ident


class main_thread_section:  # noqa: N801 - used as a function: ``with main_thread_section():``
    """A span of work (one write transaction, a caller's take-and-write of buffered records, the
    gradient evidence's judging of a backward) that a signal handler on the main thread defers
    to: :func:`after_main_writes` callbacks run when the outermost one ends. No effect on other
    threads. A class, not a generator: it is entered once per backward on a training step's path."""

    __slots__ = ("_main",)

    def __enter__(self) -> None:
        self._main = threading.get_ident() == _MAIN_IDENT
        if self._main:
            _MAIN_WRITES[0] += 1

    def __exit__(self, *_exc) -> None:
        if self._main:
            _MAIN_WRITES[0] -= 1
            if not _MAIN_WRITES[0] and _AFTER_MAIN_WRITES:
                fns = list(_AFTER_MAIN_WRITES)
                _AFTER_MAIN_WRITES.clear()
                for fn in fns:
                    fn()


@contextmanager
def write_session(engine: Engine) -> Iterator[Session]:
    """One transaction: committed on success, rolled back (nothing kept) on any error."""
    with main_thread_section(), Session(engine, expire_on_commit=False) as s, s.begin():
        yield s


class Interner:
    """Maps strings to ``strings.id`` inside one session, inserting each new string once."""

    def __init__(self, session: Session):
        self.session = session
        self._ids: dict[str, int] = {}

    def __call__(self, value: str | None) -> int | None:
        if value is None:
            return None
        got = self._ids.get(value)
        if got is not None:
            return got
        row_id = self.session.scalar(select(InternedString.id).where(InternedString.value == value))
        if row_id is None:
            row = InternedString(value=value)
            self.session.add(row)
            self.session.flush()
            row_id = row.id
        self._ids[value] = row_id
        return row_id

    def many(self, values) -> None:
        """Intern every string of ``values`` (None skipped) with one SELECT and one INSERT per
        500 new strings instead of a SELECT, an INSERT and a flush each; later calls of the
        interner find them in its cache. Used before writing a graph's nodes."""
        from sqlalchemy import insert

        from graphdeck.store.torch_trace_rows import intern_in_batches

        def lookup(part):
            return self.session.execute(select(InternedString.value, InternedString.id)
                                        .where(InternedString.value.in_(part))).all()

        def add(new):
            self.session.flush()
            self.session.execute(insert(InternedString), [{"value": v} for v in new])

        intern_in_batches(values, self._ids, lookup, add)


def get_or_create_run(session: Session, name: str, *, world_size: int | None = None, meta: dict | None = None) -> Run:
    run = session.scalar(select(Run).where(Run.name == name))
    if run is None:
        run = Run(name=name, world_size=world_size, meta_json=json.dumps(meta or {}))
        session.add(run)
        session.flush()
    elif world_size and not run.world_size:
        run.world_size = world_size
    return run


def get_or_create_rank(session: Session, run: Run, rank: int, **fields) -> Rank:
    row = session.scalar(select(Rank).where(Rank.run_id == run.id, Rank.rank == rank))
    if row is None:
        row = Rank(run_id=run.id, rank=rank, **fields)
        session.add(row)
        session.flush()
    return row


def drop_run_if_empty(engine: Engine, name: str) -> bool:
    """Delete run ``name`` when no row of any table points at it; True when it was deleted.

    A failed ingest (a full disk, a bad file) discards its own rows, but the run it registered
    in an earlier transaction would stay behind, empty; callers that created the run undo it
    with this (see :func:`undo_new_run_on_error`). The check and the delete are one transaction.
    """
    from sqlalchemy import delete, exists

    from graphdeck.store.schema import Base

    refs = [(t, fk.parent) for t in Base.metadata.sorted_tables for fk in t.foreign_keys
            if fk.column.table.name == Run.__tablename__]

    def drop() -> bool:
        with write_session(engine) as s:
            run_id = s.scalar(select(Run.id).where(Run.name == name))
            if run_id is None:
                return False
            if any(s.scalar(select(exists().where(col == run_id))) for _t, col in refs):
                return False
            s.execute(delete(Run).where(Run.id == run_id))
            return True

    return retrying(drop)


@contextmanager
def undo_new_run_on_error(engine: Engine, name: str) -> Iterator[None]:
    """Around a write into run ``name``: when the block raises and the run did not exist before
    it, the run is removed again if the failure left it empty (:func:`drop_run_if_empty`); the
    block's error propagates either way."""
    with engine.connect() as conn:
        existed = conn.execute(select(Run.id).where(Run.name == name)).first() is not None
    try:
        yield
    except BaseException:
        if not existed:
            try:
                drop_run_if_empty(engine, name)
            except Exception:  # noqa: BLE001 - keep the original error; the empty run says so itself
                import logging

                logging.getLogger(__name__).exception("could not remove the empty run %r", name)
        raise


def _retryable(exc: Exception) -> bool:
    """Another writer got in the way: SQLite's lock wait ran out, or on PostgreSQL a concurrent
    transaction inserted the same unique key first (or a serialization failure / deadlock)."""
    if isinstance(exc, IntegrityError):
        return getattr(exc.orig, "sqlstate", None) == "23505"  # unique_violation (PostgreSQL)
    if isinstance(exc, OperationalError):
        if "locked" in str(exc):
            return True
        return getattr(exc.orig, "sqlstate", None) in ("40001", "40P01")
    return False


def retrying(fn, *, attempts: int = 10):
    """Run ``fn()`` (one whole transaction); re-run it when another writer got in the way (see
    :func:`_retryable`), with a growing pause. A disk-full error becomes :class:`StoreFullError`;
    any other error, or the last attempt's, propagates."""
    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, IntegrityError) as exc:
            if is_disk_full(exc):  # a writer that used the driver directly, past the engine's hook
                raise store_full_error(exc) from exc
            if not _retryable(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    return None


def delete_run(engine: Engine, run_id: int) -> dict:
    """Delete run ``run_id`` and every row of it in one transaction: its ranks, parameters,
    graphs with their nodes, edges, bindings and kernel links, partitions, compile records,
    gradient evidence, traces with their events (rows of any table that point at one of its
    graphs or traces too), its replay runs (NOTE: [Replay runs] in :mod:`graphdeck.store.replay_runs`:
    they time its graphs) with theirs, and the upload markers (``store_meta["upload:<id>"]``) that name it, so
    uploading the same file again merges it anew. Interned strings are shared by every run and
    stay. Returns ``{"run_id", "run_name", "rows": {table: deleted}}`` (``rows["runs"]``: the run and
    its replay runs).

    Raises:
        NotFoundError: no run has that id.
    """
    from sqlalchemy import delete, func, or_

    from graphdeck.store.schema import Base, StoreMeta

    tables = [t for t in Base.metadata.sorted_tables if t.name not in ("strings", StoreMeta.__tablename__)]

    def scope(table, run_id):
        """The condition selecting ``table``'s rows that belong to the run (None: none do)."""
        conds = []
        for fk in table.foreign_keys:
            ref = fk.column.table
            if ref.name == Run.__tablename__:
                conds.append(fk.parent.in_(family))
            elif ref.name != table.name and ref.name in owned:
                conds.append(fk.parent.in_(select(ref.c.id).where(owned[ref.name])))
        return or_(*conds) if conds else None

    def drop() -> dict:
        with write_session(engine) as s:
            name = s.scalar(select(Run.name).where(Run.id == run_id).with_for_update())
            if name is None:
                raise NotFoundError(f"run {run_id} not found", resource="run", id=run_id)
            from graphdeck.store.replay_runs import replay_run_ids

            family.clear()
            family.update({run_id, *replay_run_ids(s, run_id)})  # the run and its replay runs
            owned.clear()
            owned[Run.__tablename__] = Run.id.in_(family)
            for table in tables:  # parents first: a child's condition reads its parents' rows
                if table.name != Run.__tablename__ and (cond := scope(table, run_id)) is not None:
                    owned[table.name] = cond
            rows: dict[str, int] = {}
            for table in reversed(tables):  # children first
                if table.name in owned:
                    # counted before: a row removed by an ON DELETE CASCADE of the same statement
                    # (a graph's child graphs, through parent_id) is not in the rowcount
                    n = s.scalar(select(func.count()).select_from(table).where(owned[table.name])) or 0
                    if n:
                        s.execute(delete(table).where(owned[table.name]))
                        rows[table.name] = n
            markers = [key for key, value in s.execute(select(StoreMeta.key, StoreMeta.value)
                                                      .where(StoreMeta.key.like("upload:%")))
                       if _names_run(value, run_id)]
            if markers:
                s.execute(delete(StoreMeta).where(StoreMeta.key.in_(markers)))
                rows["upload_markers"] = len(markers)
            return {"run_id": run_id, "run_name": name, "rows": rows}

    owned: dict = {}
    family: set[int] = set()
    return retrying(drop)


def _names_run(marker_value: str | None, run_id: int) -> bool:
    try:
        return json.loads(marker_value or "{}").get("run_id") == run_id
    except (ValueError, AttributeError):
        return False


#: ``GRAPHDECK_STALE_INGEST_S``: a trace still ``ingesting`` this many seconds after it was
#: created, and whose rows did not change for ``GRAPHDECK_STALE_PROBE_S``, lost its writer.
STALE_INGEST_ENV, STALE_PROBE_ENV = "GRAPHDECK_STALE_INGEST_S", "GRAPHDECK_STALE_PROBE_S"
STALE_INGEST_S, STALE_PROBE_S = 1800.0, 30.0


def sweep_dead_ingests(engine: Engine) -> list[int]:
    """Delete traces still ``ingesting`` whose writer ran on this host and is gone (NOTE: [Writer
    stamps]), at once: no age, no probe. Returns their ids; cheap when there are none (one query)."""
    from graphdeck.store.schema import Trace
    from graphdeck.store.writers import WRITER_KEY, alive

    def writer(meta_json):
        try:
            meta = json.loads(meta_json or "{}")
        except ValueError:
            return None
        return meta.get(WRITER_KEY) if isinstance(meta, dict) else None

    with engine.connect() as conn:
        rows = conn.execute(select(Trace.id, Trace.meta_json).where(Trace.status == "ingesting")).all()
    return [tid for tid, meta_json in rows if alive(writer(meta_json)) is False
            and _drop_trace_if(engine, tid, lambda s, meta: alive(writer(meta)) is False)]


def _drop_trace_if(engine: Engine, trace_id: int, still_dead) -> bool:
    """Delete trace ``trace_id`` and its events in one transaction that locks the trace row,
    when it is still ``ingesting`` and ``still_dead(session, meta_json)`` holds (a writer that
    finished meanwhile is never cut short). Returns whether it was deleted; retried on a lock."""
    from sqlalchemy import delete

    from graphdeck.store.schema import Trace, TraceEvent

    def drop() -> bool:
        with write_session(engine) as s:
            row = s.execute(select(Trace.status, Trace.meta_json).where(Trace.id == trace_id)
                            .with_for_update()).first()
            if row is None or row[0] != "ingesting" or not still_dead(s, row[1]):
                return False
            s.execute(delete(TraceEvent).where(TraceEvent.trace_id == trace_id))
            s.execute(delete(Trace).where(Trace.id == trace_id))
            return True

    return retrying(drop)


def sweep_stale_traces(engine: Engine, *, older_than_s: float | None = None, probe_s: float | None = None,
                       sleep=time.sleep) -> list[int]:
    """Delete traces whose ingest died (NOTE: [Stale ingests]); returns their ids.

    # NOTE: [Stale ingests] An ingest writes its trace as ``ingesting`` and its events batch by
    # batch; a writer killed mid-way (kill -9, a crash, a server restart) leaves them behind, and
    # readers skip them for ever. A trace is stale when it is older than ``older_than_s`` and
    # its event rows (count and newest id) did not change over ``probe_s``: a live writer, even
    # a slow one, adds a batch far more often. The check and the delete are one transaction
    # that locks the trace row, so a writer finishing meanwhile is never cut short.
    """
    import datetime as dt

    from sqlalchemy import func

    from graphdeck.store.schema import Trace, TraceEvent

    older_than_s = float(os.environ.get(STALE_INGEST_ENV, STALE_INGEST_S)) if older_than_s is None else older_than_s
    probe_s = float(os.environ.get(STALE_PROBE_ENV, STALE_PROBE_S)) if probe_s is None else probe_s
    now = dt.datetime.now(dt.timezone.utc)

    def progress(conn, trace_id):
        return tuple(conn.execute(select(func.count(), func.max(TraceEvent.id))
                                  .where(TraceEvent.trace_id == trace_id)).one())

    with engine.connect() as conn:
        rows = conn.execute(select(Trace.id, Trace.created_at).where(Trace.status == "ingesting")).all()
        old = [tid for tid, created in rows if created is None
               or (now - (created if created.tzinfo else created.replace(tzinfo=dt.timezone.utc))).total_seconds()
               >= older_than_s]
        before = {tid: progress(conn, tid) for tid in old}
    if not old:
        return []
    sleep(probe_s)
    return [tid for tid in old if _drop_trace_if(engine, tid, lambda s, _meta, tid=tid: progress(s, tid) == before[tid])]
