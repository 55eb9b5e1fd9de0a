"""Writing parsed trace events: one transaction per batch, strings interned in bulk.

:mod:`graphdeck.store.traces` parses and hands over batches of rows; this module turns them into
``trace_events`` rows of one trace, on SQLite (the driver's ``executemany``) or on another
database (PostgreSQL: ``COPY``; any other: SQLAlchemy Core's ``insert``).

A row, as the ingest builds it, is ``(ph, name, cat, ts_ns, dur_ns, pid, tid, correlation,
args_json)``; ``name`` and ``cat`` are ``strings.id`` ints when the string was interned by an
earlier batch, else the string itself (listed in the batch's ``new_strings``), and ``cat`` may
be None.
"""

from __future__ import annotations

import sqlite3

from sqlalchemy import insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from graphdeck.store.db import Interner, retrying, write_session
from graphdeck.store.schema import InternedString, TraceEvent

EVENT_COLUMNS = ("trace_id", "ph", "name_id", "cat_id", "ts_ns", "dur_ns", "pid", "tid", "correlation", "args_json")
_PLACEHOLDERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}
#: WAL pages an ingest's batches let accumulate before a checkpoint (see ``_write_sqlite``).
INGEST_WAL_PAGES = 32_768


class _BatchInterner(Interner):
    """An :class:`Interner` for one batch transaction.

    Its cache starts from the ids committed earlier in this ingest, and :meth:`prime` resolves a
    batch's new strings in bulk (one ``SELECT ... IN`` and one multi-row ``INSERT ... RETURNING``
    per 500 strings) instead of a round trip each. ``new_ids`` join the ingest's cache only once
    the batch has committed, so a rolled-back batch leaves no stale id behind.
    """

    def __init__(self, session, committed: dict[str, int]):
        super().__init__(session)
        self._ids = dict(committed)
        self.new_ids: dict[str, int] = {}

    def prime(self, values) -> None:
        missing = [v for v in dict.fromkeys(values) if v is not None and v not in self._ids]
        for i in range(0, len(missing), 500):
            chunk = missing[i : i + 500]
            rows = self.session.execute(
                select(InternedString.value, InternedString.id).where(InternedString.value.in_(chunk))
            )
            found = dict(rows.all())
            new = [v for v in chunk if v not in found]
            if new:
                stmt = insert(InternedString).returning(InternedString.value, InternedString.id)
                found.update(dict(self.session.execute(stmt, [{"value": v} for v in new]).all()))
            self.new_ids.update(found)
            self._ids.update(found)


class EventWriter:
    """Writes batches of rows (see the module docstring) as ``trace_events`` of ``trace_id``.

    ``string_ids`` (str → ``strings.id``) holds the strings committed so far; the caller reads it
    to put ids into rows and :meth:`write` adds each batch's new strings after its commit.

    # NOTE: [Driver-level insert]
    SQLAlchemy's per-row parameter processing costs more than SQLite's insert itself (3.2 s vs
    1.4 s for 200k events), so on SQLite the rows go to the DBAPI's ``executemany`` as tuples,
    with the trace id written into the statement and foreign-key checks off for the batch
    (:meth:`_write_sqlite`). PostgreSQL (psycopg 3) takes them through
    ``COPY ... FROM STDIN``, its bulk path; any other database through Core's ``insert``.
    """

    def __init__(self, engine: Engine, trace_id: int, string_ids: dict[str, int]):
        self.engine = engine
        self.trace_id = int(trace_id)
        self.string_ids = string_ids
        #: ``(count, first id, last id)`` of the ``X`` rows written so far (NOTE: [Fingerprint at
        #: write]); None when this writer cannot tell (not SQLite's ``executemany``).
        self.x_ids: tuple[int, int | None, int | None] | None = (0, None, None)
        dialect = engine.dialect
        cols = ", ".join(EVENT_COLUMNS)
        self.mode = "core"
        if dialect.name == "sqlite" and dialect.paramstyle in _PLACEHOLDERS:
            mark = _PLACEHOLDERS[dialect.paramstyle]
            self.mode = "executemany"
            self.sql = (f"INSERT INTO {TraceEvent.__tablename__} ({cols}) "
                        f"VALUES ({self.trace_id}, {', '.join([mark] * (len(EVENT_COLUMNS) - 1))})")
        elif dialect.name == "postgresql" and dialect.driver == "psycopg":
            self.mode = "copy"
            self.sql = f"COPY {TraceEvent.__tablename__} ({cols}) FROM STDIN"

    def write(self, rows: list[tuple], new_strings: set[str], unresolved: list[int]) -> None:
        """Write ``rows`` in one transaction (retried while SQLite is locked by another writer).
        ``unresolved`` lists the rows whose name or category is still a string.

        Written in the ingest's own thread: a writer thread (sqlite3 releases the GIL while
        SQLite steps an insert) measured slower, 3.6 s vs 3.0 s CPU and 9.6 s vs 7.4 s wall on
        the xdit trace at load 8-12 on 2 cores: the GIL is handed back and forth for every row.
        """

        def resolve(ids: dict[str, int]) -> list[tuple]:
            if not unresolved:
                return rows
            params = list(rows)
            for i in unresolved:
                r = params[i]
                params[i] = (r[0], ids[r[1]] if type(r[1]) is str else r[1], ids[r[2]] if type(r[2]) is str else r[2], *r[3:])
            return params

        if self.mode == "executemany":
            new_ids, last = retrying(lambda: self._write_sqlite(rows, new_strings, resolve))
            self.string_ids.update(new_ids)
            self._count_x(rows, last)
            return
        self.x_ids = None

        def write():
            with write_session(self.engine) as s:
                new_ids: dict[str, int] = {}
                ids = self.string_ids
                if new_strings:
                    interner = _BatchInterner(s, self.string_ids)
                    interner.prime(sorted(new_strings))
                    ids, new_ids = interner._ids, interner.new_ids
                params = resolve(ids)
                if self.mode == "copy":
                    with s.connection().connection.driver_connection.cursor() as cur, cur.copy(self.sql) as copy:
                        for row in params:
                            copy.write_row((self.trace_id, *row))
                else:
                    keys = EVENT_COLUMNS[1:]
                    s.execute(TraceEvent.__table__.insert(),
                              [{"trace_id": self.trace_id, **dict(zip(keys, row))} for row in params])
            return new_ids

        self.string_ids.update(retrying(write))

    def _count_x(self, rows: list[tuple], last: int) -> None:
        """Add a committed batch's ``X`` rows to :attr:`x_ids`.

        # NOTE: [Fingerprint at write]
        The kept kernel links record the trace's ``X`` events as ``(count, first id, last id)``
        (NOTE: [Stored kernel links]); the query for it reads every row of the trace (~0.06 CPU s
        on the 200k-event xdit trace: ``ph`` is in no index). On SQLite the ingest knows it
        already: a batch's rows are inserted in order in one ``BEGIN IMMEDIATE`` transaction into a
        table whose ``INTEGER PRIMARY KEY`` takes, when not given, one more than the largest id
        (no ``AUTOINCREMENT``; nobody else writes meanwhile), so they get the ids ``last - n + 1 ..
        last`` (``last_insert_rowid()`` after the batch, read before ``COMMIT``), checked: ``last``
        must be the table's largest id before the batch plus ``n`` (past 2**63 - 1 SQLite picks
        random ids). Otherwise, and on other databases, the query is used.
        tests/test_headline_map.py checks it against the query."""
        if self.x_ids is None or not rows:
            return
        phs = [r[0] for r in rows]
        n = phs.count("X")
        if not n:
            return
        base = last - len(rows) + 1
        first = base + phs.index("X")
        end = base + len(phs) - 1 - phs[::-1].index("X")
        count, lo, _hi = self.x_ids
        self.x_ids = (count + n, first if lo is None else lo, end)

    def _write_sqlite(self, rows, new_strings, resolve) -> tuple[dict[str, int], int]:
        """One ``BEGIN IMMEDIATE`` transaction on the DBAPI connection, with foreign-key checks
        off for it (they cost a third of the insert time; the trace and string ids are this
        ingest's own, just written or read in the same transaction). The pragma can only change
        outside a transaction, so it is set before ``BEGIN`` and restored after ``COMMIT``.

        The batch's commit also leaves the WAL to grow to :data:`INGEST_WAL_PAGES` before it is
        checkpointed (SQLite's default: 1,000 pages). Each checkpoint costs two fsyncs
        (``synchronous=NORMAL``), ~25 of them for a 60 MB trace; on this shared disk they were
        about a second of an ingest's wall time. Durability and the no-half-written-trace
        guarantee are unchanged (each batch still commits; the WAL is checkpointed later)."""
        pooled = self.engine.raw_connection()
        try:
            con = pooled.driver_connection
            ckpt = con.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
            con.execute("PRAGMA foreign_keys=OFF")
            con.execute(f"PRAGMA wal_autocheckpoint={max(ckpt, INGEST_WAL_PAGES)}")
            try:
                con.execute("BEGIN IMMEDIATE")
                try:
                    new_ids = _intern_sqlite(con, new_strings, self.string_ids)
                    before = con.execute(f"SELECT max(id) FROM {TraceEvent.__tablename__}").fetchone()[0] or 0
                    con.executemany(self.sql, resolve({**self.string_ids, **new_ids} if new_ids else self.string_ids))
                    last = con.execute("SELECT last_insert_rowid()").fetchone()[0]  # NOTE: [Fingerprint at write]
                    if last != before + len(rows):  # not consecutive (ids past 2**63 - 1 are random)
                        self.x_ids = None
                    con.execute("COMMIT")
                except BaseException:
                    if con.in_transaction:  # SQLITE_FULL (disk full, quota) has rolled it back already
                        con.execute("ROLLBACK")
                    raise
            finally:
                con.execute("PRAGMA foreign_keys=ON")
                con.execute(f"PRAGMA wal_autocheckpoint={int(ckpt)}")
        except sqlite3.OperationalError as exc:  # as SQLAlchemy reports it, so that retrying() sees it
            raise OperationalError(self.sql, None, exc) from exc
        finally:
            pooled.close()
        return new_ids, last


def _intern_sqlite(con, values: set[str], known: dict[str, int]) -> dict[str, int]:
    """ids of the strings in ``values`` that ``known`` lacks, inserting the missing ones."""
    missing = sorted(v for v in values if v not in known)
    found: dict[str, int] = {}
    for i in range(0, len(missing), 500):
        chunk = missing[i : i + 500]
        found.update(con.execute(f"SELECT value, id FROM {InternedString.__tablename__} WHERE value IN "
                                 f"({', '.join('?' * len(chunk))})", chunk).fetchall())
    for v in missing:
        if v not in found:
            found[v] = con.execute(f"INSERT INTO {InternedString.__tablename__} (value) VALUES (?)", (v,)).lastrowid
    return found
