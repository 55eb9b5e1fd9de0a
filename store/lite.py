"""The SQLite store through the standard library's ``sqlite3`` alone: paths, connection pragmas,
driver-error translation, and opening a writer's connection (creating a new store from the
generated DDL, :mod:`graphdeck.store.sqlite_ddl`) without importing SQLAlchemy.

# NOTE: [SQLite store without SQLAlchemy] Importing SQLAlchemy and the ORM schema costs ~0.3 s
# CPU, as much as parsing a 2-rank TORCH_TRACE folder; ``graphdeck import`` of logs into a SQLite
# store writes through ``sqlite3`` instead (:func:`open_store`, then
# :class:`graphdeck.store.torch_trace_rows.SqliteWriter`). A new store gets the statements
# ``Base.metadata.create_all`` emits on SQLite plus Alembic's version row, read from
# ``store/sqlite_ddl.py``, which is generated from ``store/schema.py``
# (``python -m graphdeck.store.migrate --write-sqlite-ddl``; a test pins that the file equals the
# generator's output and that both stores hold the same rows), so the schema is still declared
# once. A store at the head revision is opened as it is; anything else (older, pre-Alembic, not
# a store, unreadable) answers ``None`` and the caller opens it through
# :func:`graphdeck.store.db.open_engine`, which migrates or says what is wrong.

:mod:`graphdeck.store.db` re-exports the helpers here (``store_url``, ``create_private_file``,
``is_disk_full``, ``store_full_error``, ``is_bad_value``) and runs :func:`apply_pragmas` on every
SQLAlchemy connection, so both ways of writing use the same settings.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import time
from pathlib import Path

from graphdeck.errors import BadInputError, StoreFullError, UnsafePathError

BUSY_TIMEOUT_MS = 60_000
#: Environment variable: a size quota in bytes for SQLite stores opened for writing (``PRAGMA
#: max_page_count``); a write past it fails with :class:`StoreFullError`. Unset: no quota.
MAX_BYTES_ENV = "GRAPHDECK_STORE_MAX_BYTES"


def store_url(path_or_url: str | os.PathLike) -> str:
    """``'runs.db'`` → ``'sqlite:////abs/runs.db'``; a URL with ``://`` is returned unchanged.

    ``postgres://`` and ``postgresql://`` (libpq's spellings) become ``postgresql+psycopg://``."""
    text = str(path_or_url)
    if "://" in text:
        for prefix in ("postgres://", "postgresql://"):
            if text.startswith(prefix):
                return "postgresql+psycopg://" + text[len(prefix):]
        return text
    return f"sqlite:///{Path(text).expanduser().resolve()}"


def sqlite_path(path_or_url: str | os.PathLike) -> str | None:
    """The file of a SQLite store given as a path or a plain ``sqlite:///`` URL; ``None`` for any
    other URL (PostgreSQL, in-memory, URI filenames or query options: SQLAlchemy's to open)."""
    url = store_url(path_or_url)
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):]
    if not path or path == ":memory:" or path.startswith("file:") or "?" in path:
        return None
    return path


def fs_text(name: str) -> str:
    r"""A file name as text a store can hold. A name that is not UTF-8 comes from the file system
    with its bytes as lone surrogates (PEP 383: byte 0xff is ``'\udcff'``), which neither SQLite's
    driver nor psycopg can encode; each such byte is written as the four characters ``\xff``
    (any other lone surrogate as ``\ud800``). A UTF-8 name comes back unchanged."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        pass
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


#: The files SQLite keeps beside a store ``x.db``: ``x.db-wal``, ``x.db-shm``, ``x.db-journal``.
SIDECARS = ("-wal", "-shm", "-journal")


def refuse_symlinks(path: str | os.PathLike) -> None:
    """Refuse a SQLite store whose file or a file beside it (:data:`SIDECARS`) is a symbolic link
    someone planted: SQLite itself will not open a ``-wal`` through one ("unable to open database
    file", which read as "not a graphdeck store"), and a writer must not write through it.

    Raises:
        UnsafePathError: (403, exit 2) naming the link and its target."""
    for name in ("", *SIDECARS):
        p = f"{os.fspath(path)}{name}"
        if os.path.islink(p) and (name or not os.path.exists(p)):
            raise UnsafePathError(f"refusing the store {os.fspath(path)}: {p} is a symbolic link (to {os.readlink(p)}) "
                                  "that SQLite will not use; remove it if you did not make it")


def create_private_file(path: str | os.PathLike) -> None:
    """Create ``path`` empty with mode 0600 unless it exists (a symlink is not followed).

    SQLite creates a database with 0644 and its ``-wal`` / ``-shm`` with the database's own
    mode, so a store made by graphdeck was readable by every local user; created here first,
    the store and its WAL files are the owner's only. An existing file keeps its mode."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        os.close(os.open(path, flags, 0o600))
    except FileExistsError:
        pass


def _wal(cur) -> None:
    """``PRAGMA journal_mode=WAL``, waiting for a rank that is creating the same new store: that
    switch can answer "database is locked" at once, without SQLite's busy handler (two torchrun
    ranks opening one fresh store). WAL is kept by the file, so a store already in WAL skips it."""
    import sqlite3

    if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def apply_pragmas(dbapi_conn, read_only: bool, max_bytes: int | None) -> None:
    """The settings of every store connection: ``busy_timeout``, read-only (``query_only``) or
    WAL + ``synchronous=NORMAL`` + the size quota ``max_bytes`` (``max_page_count``), and
    ``foreign_keys=ON``."""
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    if read_only:
        cur.execute("PRAGMA query_only=1")
    else:
        _wal(cur)
        cur.execute("PRAGMA synchronous=NORMAL")
        if max_bytes:
            page_size = cur.execute("PRAGMA page_size").fetchone()[0]
            cur.execute(f"PRAGMA max_page_count={max(1, math.ceil(max_bytes / page_size))}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def is_disk_full(exc: BaseException) -> bool:
    """Whether a driver error means "no space": SQLite ``database or disk is full`` (also its
    ``max_page_count`` quota), PostgreSQL SQLSTATE ``53100``, or ``ENOSPC``."""
    orig = getattr(exc, "orig", exc)
    if getattr(orig, "sqlstate", None) == "53100" or getattr(orig, "pgcode", None) == "53100":
        return True
    if getattr(orig, "sqlite_errorname", None) == "SQLITE_FULL":
        return True
    message = str(orig).lower()
    return "database or disk is full" in message or "no space left on device" in message


def store_full_error(exc: BaseException) -> StoreFullError:
    """The :class:`StoreFullError` to raise for a driver error that :func:`is_disk_full` says is
    "no space" (writers that talk to the driver directly raise it themselves)."""
    return StoreFullError(
        f"store is full (disk full or the store's size quota was reached): {getattr(exc, 'orig', exc)}; "
        "the write was rolled back, nothing of it is stored",
        cause="disk_full",
    )


def is_bad_value(exc: BaseException) -> bool:
    """Whether a driver error is about a value rather than the database: pysqlite's
    ``OverflowError`` (an int past 64 bits) and ``DataError``; PostgreSQL SQLSTATE class 22
    (data exception) and psycopg's own ``DataError`` (NUL in text, raised before sending)."""
    if isinstance(exc, OverflowError):
        return True
    if not any(cls.__name__ == "DataError" for cls in type(exc).__mro__):  # sqlite3's, psycopg's and subclasses
        return False
    state = getattr(exc, "sqlstate", None)
    return state is None or str(state).startswith("22")


def translate_error(exc: BaseException, table: str | None = None) -> None:
    """Raise the graphdeck error for a driver error of a write to ``table``: disk full →
    :class:`StoreFullError`, a value the store cannot hold → :class:`BadInputError` (400); any
    other error returns (the caller re-raises it)."""
    if is_disk_full(exc):
        raise store_full_error(exc) from exc
    if is_bad_value(exc):
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        where = f" in {table}" if table else ""
        raise BadInputError(f"the store cannot hold or compare a value{where}: {message}",
                            **({"table": table} if table else {})) from exc


def sqlite_now() -> str:
    """Now (UTC) as SQLAlchemy's SQLite ``DateTime`` stores it: ``'2026-12-01 23:39:05.123456'``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def open_store(path: str | os.PathLike, *, max_bytes: int | None = None):
    """A writer's ``sqlite3`` connection (autocommit mode: the caller issues ``BEGIN IMMEDIATE`` /
    ``COMMIT``) to the SQLite store at ``path``, created with the schema when it is new or
    empty (mode 0600); ``None`` when the store is not at this graphdeck's head revision or cannot
    be read here (open it with :func:`graphdeck.store.db.open_engine` then: it migrates, or
    raises the error that says why). See NOTE: [SQLite store without SQLAlchemy].

    ``max_bytes``: the size quota (default ``$GRAPHDECK_STORE_MAX_BYTES``)."""
    import sqlite3

    from graphdeck.store import sqlite_ddl

    try:
        refuse_symlinks(path)
        create_private_file(path)
    except (OSError, UnsafePathError):
        return None  # a folder that does not exist, a planted link: open_engine says so
    if max_bytes is None and os.environ.get(MAX_BYTES_ENV):
        max_bytes = int(os.environ[MAX_BYTES_ENV])
    conn = None
    try:
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        apply_pragmas(conn, False, max_bytes)
        if not _tables(conn):
            conn.execute("BEGIN IMMEDIATE")  # sixteen ranks opening one new store create it once
            if not _tables(conn):
                for statement in sqlite_ddl.DDL:
                    conn.execute(statement)
                conn.execute("INSERT INTO store_meta (key, value) VALUES ('schema_version', ?)",
                             (str(sqlite_ddl.SCHEMA_VERSION),))
                conn.execute("INSERT INTO alembic_version (version_num) VALUES (?)", (sqlite_ddl.REVISION,))
            conn.execute("COMMIT")
        if _at_head(conn):
            return conn
    except sqlite3.Error as exc:
        if conn is not None and conn.in_transaction:
            conn.execute("ROLLBACK")
        if is_disk_full(exc):
            conn.close()
            raise store_full_error(exc) from exc
    if conn is not None:
        conn.close()
    return None


def _tables(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]


def _at_head(conn) -> bool:
    from graphdeck.store import sqlite_ddl

    names = set(_tables(conn))
    if not {"alembic_version", "store_meta"} <= names:
        return False
    rev = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    meta = conn.execute("SELECT value FROM store_meta WHERE key = 'schema_version'").fetchall()
    return rev == [(sqlite_ddl.REVISION,)] and meta == [(str(sqlite_ddl.SCHEMA_VERSION),)]
