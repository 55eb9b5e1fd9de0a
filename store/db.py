"""Opening the store: engines, sessions, string interning, run/rank registration.

The embedded default is one SQLite file in WAL mode, so several rank processes can write to it
at once (SQLite serialises writers; ``busy_timeout`` makes each wait instead of failing) while
the server reads. Each logical write (a graph with its nodes, a batch of trace events) is one
transaction, so a rank that dies mid-write leaves no half-written graph behind.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from graphdeck.errors import NotFoundError, StoreError
from graphdeck.store.schema import SCHEMA_VERSION, Base, InternedString, Rank, Run, StoreMeta

BUSY_TIMEOUT_MS = 60_000


def store_url(path_or_url: str | os.PathLike) -> str:
    """``'runs.db'`` → ``'sqlite:///runs.db'``; a URL with ``://`` is returned unchanged."""
    text = str(path_or_url)
    if "://" in text:
        return text
    return f"sqlite:///{Path(text).expanduser().resolve()}"


def _sqlite_pragmas(read_only: bool):
    def on_connect(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        if read_only:
            cur.execute("PRAGMA query_only=1")
        else:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    return on_connect


def _autocommit_driver(dbapi_conn, _record):
    dbapi_conn.isolation_level = None


def open_engine(path_or_url: str | os.PathLike, *, read_only: bool = False, create: bool = True) -> Engine:
    """Open (and, unless ``read_only``, create) the store at ``path_or_url``.

    Raises:
        NotFoundError: the file is missing while ``read_only`` (CLI exit 2: a usage problem).
        StoreError: it is not a graphdeck store, or its schema version differs from
            :data:`graphdeck.store.schema.SCHEMA_VERSION`.
    """
    url = store_url(path_or_url)
    is_sqlite = url.startswith("sqlite")
    if is_sqlite and read_only:
        path = url.split("sqlite:///", 1)[1]
        if not Path(path).exists():
            raise NotFoundError(f"store {path} does not exist; run a captured job or `graphdeck demo` first",
                                resource="store", id=path)
    engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000} if is_sqlite else {})
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_pragmas(read_only))
        if not read_only:
            # NOTE: [Immediate transactions] pysqlite defers BEGIN until the first write, so two
            # ranks can both read "no such run" and then both insert it. We take the write lock
            # at BEGIN instead (SQLAlchemy's documented pysqlite recipe), which serialises
            # read-then-write transactions across processes; busy_timeout makes others wait.
            event.listen(engine, "connect", _autocommit_driver)
            event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    if create and not read_only:
        _create_schema(engine)
    _check_version(engine)
    return engine


def _create_schema(engine: Engine) -> None:
    # Several ranks may race to create the schema; each retries until one has won.
    for attempt in range(20):
        try:
            Base.metadata.create_all(engine)
            with Session(engine) as s, s.begin():
                if s.get(StoreMeta, "schema_version") is None:
                    s.add(StoreMeta(key="schema_version", value=str(SCHEMA_VERSION)))
            return
        except OperationalError:
            if attempt == 19:
                raise
            time.sleep(0.05 * (attempt + 1))
        except Exception as exc:  # IntegrityError: another rank inserted the version row first
            if "UNIQUE" in str(exc) or "IntegrityError" in type(exc).__name__:
                return
            raise


def _check_version(engine: Engine) -> None:
    with Session(engine) as s:
        try:
            row = s.get(StoreMeta, "schema_version")
        except OperationalError as exc:
            raise StoreError(f"not a graphdeck store: {exc.orig}") from exc
        if row is not None and int(row.value) != SCHEMA_VERSION:
            raise StoreError(
                f"store schema version {row.value} but this graphdeck reads version {SCHEMA_VERSION}"
            )


def session_factory(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def write_session(engine: Engine) -> Iterator[Session]:
    """One transaction: committed on success, rolled back (nothing kept) on any error."""
    with Session(engine, expire_on_commit=False) as s:
        with s.begin():
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


def retrying(fn, *, attempts: int = 10):
    """Run ``fn()``; retry on SQLite ``database is locked`` (another rank holds the write lock)."""
    for attempt in range(attempts):
        try:
            return fn()
        except OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    return None
