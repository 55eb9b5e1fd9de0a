"""Rows of a TORCH_TRACE import into the store through the DB-API: the one place the import's
SQL is written, run either straight on ``sqlite3`` (:class:`SqliteWriter`: a SQLite store at the
head revision, without importing SQLAlchemy; NOTE: [SQLite store without SQLAlchemy] in
store/lite.py) or on a SQLAlchemy connection (:class:`EngineWriter`: PostgreSQL, a store that
had to be migrated, or an engine the caller already holds), with ``exec_driver_sql`` so the
engine's error hooks apply.

Statements use ``?`` placeholders (``%s`` on drivers of the ``format`` / ``pyformat`` style) and
quote column names (``partitions.index`` is a keyword). Columns a caller leaves out of
:meth:`RowWriter.insert` get the schema's defaults (``store/sqlite_ddl.py``'s ``DEFAULTS``, made
from store/schema.py), so a row is the same whichever writer stores it.

Errors: a full disk or quota raises :class:`~graphdeck.errors.StoreFullError`, a value the store
cannot hold :class:`~graphdeck.errors.BadInputError` (both writers); other driver errors
propagate.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Sequence
from typing import Any

#: Strings looked up / inserted per statement when interning.
INTERN_BATCH = 500


def _quoted(cols: Iterable[str]) -> str:
    return ", ".join(f'"{c}"' for c in cols)


class RowWriter:
    """Inserts, updates and string interning over one connection, in transactions the caller
    opens with :meth:`begin` and ends with :meth:`commit` / :meth:`rollback`.

    Subclasses provide ``_run(sql, params) -> cursor``, ``_run_many(sql, rows)``, ``begin``,
    ``commit``, ``rollback``, ``close`` and ``now()`` (the current time as the backend stores
    a ``DateTime``)."""

    paramstyle = "qmark"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}  # interned string -> strings.id

    # ------------------------------------------------------------------ backend primitives
    def _run(self, sql: str, params: Sequence = ()):  # pragma: no cover - abstract
        raise NotImplementedError

    def _run_many(self, sql: str, rows: list[Sequence]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def begin(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def commit(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def rollback(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def now(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _sql(self, sql: str) -> str:
        return sql if self.paramstyle == "qmark" else sql.replace("?", "%s")

    # ------------------------------------------------------------------ statements
    def rows(self, sql: str, params: Sequence = ()) -> list[tuple]:
        """All rows of a query (``?`` placeholders)."""
        return [tuple(r) for r in self._run(self._sql(sql), tuple(params)).fetchall()]

    def scalar(self, sql: str, params: Sequence = ()) -> Any:
        got = self.rows(sql, params)
        return got[0][0] if got else None

    def execute(self, sql: str, params: Sequence = ()) -> None:
        self._run(self._sql(sql), tuple(params))

    def insert(self, table: str, row: dict[str, Any]) -> int:
        """Insert one row (schema defaults for the columns left out); returns its ``id``."""
        from graphdeck.store.sqlite_ddl import DEFAULTS

        full = {c: (self.now() if v == "<now>" else v) for c, v in DEFAULTS.get(table, {}).items() if c not in row}
        full.update(row)
        sql = f"INSERT INTO {table} ({_quoted(full)}) VALUES ({', '.join('?' * len(full))}) RETURNING id"
        return self._run(self._sql(sql), tuple(full.values())).fetchone()[0]

    def insert_many(self, table: str, cols: Sequence[str], rows: list[Sequence]) -> None:
        """executemany of ``rows`` (tuples in the order of ``cols``, every column given)."""
        if rows:
            self._run_many(self._sql(f"INSERT INTO {table} ({_quoted(cols)}) VALUES ({', '.join('?' * len(cols))})"),
                           rows)

    def update(self, table: str, row_id: int, values: dict[str, Any]) -> None:
        sets = ", ".join(f'"{c}" = ?' for c in values)
        self.execute(f"UPDATE {table} SET {sets} WHERE id = ?", (*values.values(), row_id))

    # ------------------------------------------------------------------ interned strings
    def intern(self, value: str | None) -> int | None:
        """``strings.id`` of ``value`` (inserted when new); ``None`` for ``None``."""
        if value is None:
            return None
        got = self._ids.get(value)
        if got is None:
            self.intern_many([value])
            got = self._ids[value]
        return got

    def intern_many(self, values: Iterable[str | None]) -> None:
        """Intern every string of ``values`` (None skipped) (:func:`intern_in_batches`);
        :meth:`intern` then finds them in its cache."""
        intern_in_batches(values, self._ids, self._lookup,
                          lambda new: self.insert_many("strings", ("value",), [(v,) for v in new]))

    def _lookup(self, values: list[str]) -> list[tuple]:
        return self.rows(f"SELECT value, id FROM strings WHERE value IN ({', '.join('?' * len(values))})", values)


def intern_in_batches(values: Iterable[str | None], ids: dict[str, int], lookup, insert) -> None:
    """Add every string of ``values`` (None skipped) to ``ids`` (string → ``strings.id``) with one
    ``lookup(part)`` (→ (value, id) pairs of those stored) and, for the new ones, one
    ``insert(new)`` and a second lookup per :data:`INTERN_BATCH` strings. Shared by
    :class:`RowWriter` and :class:`graphdeck.store.db.Interner` (ORM sessions)."""
    todo = list(dict.fromkeys(v for v in values if v is not None and v not in ids))
    for i in range(0, len(todo), INTERN_BATCH):
        part = todo[i:i + INTERN_BATCH]
        found = dict(lookup(part))
        new = [v for v in part if v not in found]
        if new:
            insert(new)
            found.update(lookup(new))
        ids.update(found)


class SqliteWriter(RowWriter):
    """A :class:`RowWriter` on a ``sqlite3`` connection in autocommit mode (from
    :func:`graphdeck.store.lite.open_store`): ``BEGIN IMMEDIATE`` takes the write lock at once
    (NOTE: [Immediate transactions] in store/db.py)."""

    def __init__(self, conn) -> None:
        super().__init__()
        self.conn = conn
        self.dialect = "sqlite"

    def _guard(self, fn, sql: str, params):
        import sqlite3

        from graphdeck.store.lite import translate_error

        try:
            return fn(sql, params)
        except (sqlite3.Error, OverflowError) as exc:
            words = sql.split()
            translate_error(exc, words[2] if words[0] == "INSERT" else words[1] if words[0] == "UPDATE" else None)
            raise

    def _run(self, sql: str, params: Sequence = ()):
        return self._guard(self.conn.execute, sql, params)

    def _run_many(self, sql: str, rows: list[Sequence]) -> None:
        self._guard(self.conn.executemany, sql, rows)

    def begin(self) -> None:
        self._run("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self._run("COMMIT")

    def rollback(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def close(self) -> None:
        self.rollback()
        self.conn.close()

    def now(self) -> str:
        from graphdeck.store.lite import sqlite_now

        return sqlite_now()


class EngineWriter(RowWriter):
    """A :class:`RowWriter` on one connection of a SQLAlchemy engine (``exec_driver_sql``: the
    engine's ``handle_error`` hook turns disk-full and bad-value errors into graphdeck's).
    ``owned``: :meth:`close` disposes of the engine too."""

    def __init__(self, engine, *, owned: bool = False) -> None:
        super().__init__()
        self.engine, self.owned = engine, owned
        self.dialect = engine.dialect.name
        self.paramstyle = "qmark" if engine.dialect.paramstyle == "qmark" else "format"
        self.conn = engine.connect()
        self._tx = None

    def _run(self, sql: str, params: Sequence = ()):
        return self.conn.exec_driver_sql(sql, tuple(params) if params else None)

    def _run_many(self, sql: str, rows: list[Sequence]) -> None:
        self.conn.exec_driver_sql(sql, [tuple(r) for r in rows])

    def begin(self) -> None:
        self._tx = self.conn.begin()

    def commit(self) -> None:
        self._tx.commit()
        self._tx = None

    def rollback(self) -> None:
        if self._tx is not None:
            self._tx.rollback()
            self._tx = None

    def close(self) -> None:
        self.rollback()
        self.conn.close()
        if self.owned:
            self.engine.dispose()

    def now(self) -> Any:
        if self.dialect == "sqlite":  # as SQLAlchemy's SQLite DateTime stores it
            from graphdeck.store.lite import sqlite_now

            return sqlite_now()
        return _dt.datetime.now(_dt.timezone.utc)


def open_writer(store) -> RowWriter:
    """A writer for ``store``: a SQLAlchemy ``Engine`` (used as it is), or a SQLite path /
    ``sqlite:///`` URL (``sqlite3`` when the store is new or at the head revision, else
    :func:`~graphdeck.store.db.open_engine`, which migrates it or raises), or any other URL
    (``open_engine``).

    Raises: what :func:`graphdeck.store.db.open_engine` raises for a store it cannot open."""
    if hasattr(store, "dialect"):
        return EngineWriter(store)
    from graphdeck.store.lite import open_store, sqlite_path

    path = sqlite_path(store)
    conn = open_store(path) if path is not None else None
    if conn is not None:
        return SqliteWriter(conn)
    from graphdeck.store.db import open_engine

    return EngineWriter(open_engine(store), owned=True)
