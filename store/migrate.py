"""Schema migrations of the store (Alembic), and the version check every open makes.

The schema is :mod:`graphdeck.store.schema`; the migrations in ``store/migrations/versions`` are
named by schema version (revision ``"0002"`` is :data:`~graphdeck.store.schema.SCHEMA_VERSION` 2)
and ship inside the package, so an installed graphdeck migrates its stores without an
``alembic.ini``. A test pins that the migrations' head equals ``schema.py`` on SQLite and
PostgreSQL (Alembic's autogenerate finds no difference).

What opening a store does (:func:`prepare`):

=============================================  ===========================================
store                                          writer (``read_only=False``)
=============================================  ===========================================
empty                                          ``create_all`` + stamp head (without Alembic)
made before Alembic (``store_meta`` version N)  stamp revision N, then upgrade to head
an older revision                              upgrade to head (data kept)
the head                                       nothing
a revision this graphdeck does not know        :class:`SchemaVersionError`
=============================================  ===========================================

A read-only open never writes: an older store is refused with a message saying how to migrate it
(``graphdeck db upgrade STORE``), except a pre-Alembic store whose tables already have every
column of the head (it reads fine as it is).

The writer does all of it in one transaction under a lock (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL:
``pg_advisory_xact_lock``), so sixteen ranks opening a new store at once create it exactly once.
"""

from __future__ import annotations

import functools
from pathlib import Path

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

from graphdeck.errors import NotAStoreError, SchemaVersionError, StoreError
from graphdeck.store.schema import SCHEMA_VERSION, Base

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
#: Arbitrary key of the PostgreSQL advisory lock taken while a store is created or migrated.
PG_LOCK_KEY = 0x67726470  # "grdp"


def revision_of(version: int) -> str:
    """Schema version → Alembic revision id: ``2`` → ``"0002"``."""
    return f"{version:04d}"


def alembic_config(connection: Connection | None = None, url: str | None = None):
    """A programmatic Alembic ``Config`` for the shipped migrations (no ``alembic.ini``)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.lru_cache(maxsize=1)
def script():
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    return script().get_current_head()


def current_revision(conn: Connection) -> str | None:
    """The store's Alembic revision; ``None`` when it has no ``alembic_version`` table."""
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def _meta_version(conn: Connection) -> int | None:
    if not inspect(conn).has_table("store_meta"):
        return None
    value = conn.execute(text("SELECT value FROM store_meta WHERE key = 'schema_version'")).scalar()
    return int(value) if value is not None else None


def _version_of(revision: str) -> str:
    return str(int(revision)) if revision.isdigit() else revision


def _too_new(revision: str) -> SchemaVersionError:
    return SchemaVersionError(
        f"store schema version {_version_of(revision)} (revision {revision}) is newer than this graphdeck "
        f"{_graphdeck_version()} understands (schema version {SCHEMA_VERSION}): upgrade graphdeck to read it",
        store_version=_version_of(revision), known_version=SCHEMA_VERSION, direction="newer",
    )


def _graphdeck_version() -> str:
    import graphdeck

    return graphdeck.__version__


#: Tables added after schema 2 that a reader of an older store may find absent (read as empty:
#: ``graphdeck.analysis.gradients.evidence.load`` looks before it queries; node times are computed from
#: the trace's events when ``node_time_sets`` is absent: ``graphdeck.store.node_times``; export-trace maps
#: the events when ``trace_links`` is: ``graphdeck.analysis.traces.export_map``).
OPTIONAL_TABLES = frozenset({"grad_steps", "node_time_sets", "node_times", "trace_links"})


def _head_columns_present(conn: Connection) -> bool:
    """Whether every table and column of this schema is there, tables in ``OPTIONAL_TABLES`` aside."""
    insp = inspect(conn)
    for table in Base.metadata.sorted_tables:
        if not insp.has_table(table.name):
            if table.name in OPTIONAL_TABLES:
                continue
            return False
        have = {c["name"] for c in insp.get_columns(table.name)}
        if not {c.name for c in table.columns} <= have:
            return False
    return True


def check(conn: Connection) -> str:
    """Read-only version check; returns the store's revision (``"pre-alembic"`` for an old store
    that reads fine as it is).

    Raises:
        NotAStoreError: not a graphdeck store (no tables).
        SchemaVersionError: written by a newer graphdeck.
        SchemaVersionError: needs ``graphdeck db upgrade`` first.
    """
    rev = current_revision(conn)
    meta = _meta_version(conn)
    if meta is not None and meta > SCHEMA_VERSION:
        raise _too_new(revision_of(meta))
    if rev == revision_of(SCHEMA_VERSION):  # the common case, without loading Alembic
        return rev
    head = head_revision()
    if rev is None:
        version = meta
        if version is None:
            raise NotAStoreError("not a graphdeck store: it has no store_meta table")
        if version > SCHEMA_VERSION:
            raise _too_new(revision_of(version))
        if _head_columns_present(conn):
            return "pre-alembic"
        rev = revision_of(version)
    known = {s.revision for s in script().walk_revisions()}
    if rev not in known:
        raise _too_new(rev)
    if rev != head and _head_columns_present(conn):
        return rev  # older by optional tables only: readable as it is
    if rev != head:
        raise SchemaVersionError(
            f"store schema version {_version_of(rev)} is older than this graphdeck's {SCHEMA_VERSION}: "
            f"migrate it with `graphdeck db upgrade STORE` (or open it once read-write)",
            store_version=_version_of(rev), known_version=SCHEMA_VERSION, direction="older",
        )
    return rev


def prepare(engine: Engine, *, create: bool = True) -> str:
    """Create, adopt or migrate the store behind ``engine`` (a writer); returns the revision it is
    at afterwards (the head). See the module docstring for the cases.

    Raises:
        NotAStoreError: the database holds tables but is not a graphdeck store.
        SchemaVersionError: the store comes from a newer graphdeck (nothing is changed).
    """
    with engine.connect() as conn:  # the common case, without a write lock or loading Alembic
        names = set(inspect(conn).get_table_names())
        meta = _meta_version(conn) if "store_meta" in names else None
        if meta is not None and meta > SCHEMA_VERSION:
            raise _too_new(revision_of(meta))
        if "alembic_version" in names and current_revision(conn) == revision_of(SCHEMA_VERSION):
            return revision_of(SCHEMA_VERSION)
    if not names and create and _create_new(engine):
        return revision_of(SCHEMA_VERSION)
    from alembic import command

    head = head_revision()
    with engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE (see db.py); PostgreSQL: the advisory lock
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_LOCK_KEY})
        rev = current_revision(conn)
        if rev == head:
            return rev
        cfg = alembic_config(conn)
        if rev is None:
            version = _meta_version(conn)
            if version is None:
                names = [n for n in inspect(conn).get_table_names() if n != "alembic_version"]
                if names:
                    raise NotAStoreError(f"not a graphdeck store: it has tables {sorted(names)[:5]} but no store_meta")
                if not create:
                    raise StoreError("the store is empty (create it by opening it read-write)")
                Base.metadata.create_all(conn)
                conn.execute(text("INSERT INTO store_meta (key, value) VALUES ('schema_version', :v)"),
                             {"v": str(SCHEMA_VERSION)})
                command.stamp(cfg, head)
                return head
            rev = revision_of(version)
            known = {s.revision for s in script().walk_revisions()}
            if rev not in known:
                raise _too_new(rev)
            command.stamp(cfg, rev)  # a store made before Alembic: adopt it at its version
        known = {s.revision for s in script().walk_revisions()}
        if rev not in known:
            raise _too_new(rev)
        command.upgrade(cfg, head)
        conn.execute(text("UPDATE store_meta SET value = :v WHERE key = 'schema_version'"),
                     {"v": str(SCHEMA_VERSION)})
    return head


def _create_new(engine: Engine) -> bool:
    """Create the schema in an empty store and stamp it at the head without loading Alembic
    (NOTE: [Store creation without Alembic]); False when the store is no longer empty once the
    lock is held (another process created it meanwhile: :func:`prepare` then goes on as usual).

    # NOTE: [Store creation without Alembic] Importing Alembic and running ``command.stamp`` cost
    # ~0.15 s CPU, a tenth of a small ``graphdeck import``. A new store needs neither: it is
    # ``create_all`` plus the version row Alembic's stamp writes, in Alembic's own table layout
    # (``alembic_version``: ``version_num VARCHAR(32) NOT NULL``, primary key
    # ``alembic_version_pkc``). The head is ``revision_of(SCHEMA_VERSION)`` (a test pins that
    # the migrations' head is that revision), so later opens and upgrades see an ordinary
    # Alembic-stamped store.
    """
    version_table = _version_table()
    with engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE (see db.py); PostgreSQL: the advisory lock
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_LOCK_KEY})
        if inspect(conn).get_table_names():
            return False
        Base.metadata.create_all(conn)
        conn.execute(text("INSERT INTO store_meta (key, value) VALUES ('schema_version', :v)"),
                     {"v": str(SCHEMA_VERSION)})
        version_table.create(conn)
        conn.execute(version_table.insert().values(version_num=revision_of(SCHEMA_VERSION)))
    return True


def _version_table():
    """Alembic's ``alembic_version`` table as its stamp creates it."""
    from sqlalchemy import Column, MetaData, PrimaryKeyConstraint, String, Table

    return Table("alembic_version", MetaData(), Column("version_num", String(32), nullable=False),
                 PrimaryKeyConstraint("version_num", name="alembic_version_pkc"))


SQLITE_DDL_FILE = Path(__file__).resolve().parent / "sqlite_ddl.py"


def render_sqlite_ddl() -> str:
    """The text of ``store/sqlite_ddl.py`` (NOTE: [SQLite store without SQLAlchemy]): the
    statements :func:`_create_new` runs on SQLite (``create_all``'s CREATE TABLE / CREATE INDEX in
    its order, then Alembic's version table), compiled by SQLAlchemy's SQLite dialect from
    :mod:`graphdeck.store.schema`, with the schema version, its revision, and each table's
    column defaults (``"<now>"``: the current time)."""
    import pprint

    from sqlalchemy.dialects import sqlite
    from sqlalchemy.schema import CreateIndex, CreateTable

    dialect = sqlite.dialect()
    ddl = []
    for table in [*Base.metadata.sorted_tables, _version_table()]:
        ddl.append(str(CreateTable(table).compile(dialect=dialect)).strip())
        ddl.extend(str(CreateIndex(ix).compile(dialect=dialect)).strip()
                   for ix in sorted(table.indexes, key=lambda ix: ix.name))
    defaults = {}
    for table in Base.metadata.sorted_tables:
        cols = {c.name: ("<now>" if c.default.is_callable else c.default.arg)
                for c in table.columns if c.default is not None and not c.primary_key}
        if cols:
            defaults[table.name] = cols
    return (f'"""GENERATED from store/schema.py by `python -m graphdeck.store.migrate --write-sqlite-ddl`; do not edit\n'
            "(tests/test_import_lite.py fails when it is stale). What a new SQLite store is made of when it is\n"
            'created without SQLAlchemy: NOTE: [SQLite store without SQLAlchemy] in store/lite.py."""\n\n'
            f"SCHEMA_VERSION = {SCHEMA_VERSION}\nREVISION = {revision_of(SCHEMA_VERSION)!r}\n"
            f"DDL = {pprint.pformat(tuple(ddl), width=110)}\n"
            f"DEFAULTS = {pprint.pformat(defaults, width=110)}\n")


def describe(conn: Connection) -> dict:
    """What a store's schema is, the facts ``serve`` acts on: ``{"revision": Alembic revision or
    None, "schema_version": store_meta's or None, "head": this graphdeck's revision, "state":
    "current" | "older" | "newer" | "empty" | "not-a-store", "message": one line}``."""
    rev, head = current_revision(conn), head_revision()
    try:
        meta = _meta_version(conn)
    except ValueError:
        meta = None
    out = {"revision": rev, "schema_version": meta, "head": head}
    if rev is None and meta is None:
        names = [n for n in inspect(conn).get_table_names() if n != "alembic_version"]
        state = "not-a-store" if names else "empty"
        return {**out, "state": state, "message": "not a graphdeck store" if names else
                "empty (opening it read-write creates the schema)"}
    try:
        check(conn)
        return {**out, "state": "current", "message": "this graphdeck reads and writes it"}
    except SchemaVersionError as exc:
        return {**out, "state": exc.details.get("direction", "older"), "message": exc.message}
    except StoreError as exc:
        return {**out, "state": "not-a-store", "message": exc.message}


def upgrade(engine: Engine, revision: str = "head") -> str:
    """Migrate to ``revision`` (default the head) under the same lock as :func:`prepare`; returns
    the revision reached. Used by ``graphdeck db upgrade`` and the migration tests.

    Raises:
        UsageError: ``revision`` is not one this graphdeck ships, or older than the store's
            (migrations only go forward: nothing is changed).
        SchemaVersionError: the store is newer than this graphdeck.
    """
    from alembic import command
    from alembic.util import CommandError

    from graphdeck.errors import UsageError

    known = [s.revision for s in script().walk_revisions()]
    target = head_revision() if revision == "head" else revision
    if target not in known:
        raise UsageError(f"revision {revision!r} is not one this graphdeck {_graphdeck_version()} ships "
                         f"(it knows {', '.join(sorted(known))}; head {head_revision()})")
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_LOCK_KEY})
        cfg = alembic_config(conn)
        meta, rev = _meta_version(conn), current_revision(conn)
        if meta is not None and meta > SCHEMA_VERSION:
            raise _too_new(revision_of(meta))
        if rev is not None and rev not in known:
            raise _too_new(rev)
        at = rev or (revision_of(meta) if meta is not None else None)
        if at is not None and at.isdigit() and target.isdigit() and int(at) > int(target):
            raise UsageError(f"the store is at revision {at}, past the requested {target}: graphdeck db upgrade "
                             "does not downgrade (nothing was changed)", store_revision=at, requested=target)
        try:
            if rev is None and meta is not None:
                command.stamp(cfg, revision_of(meta))
            command.upgrade(cfg, revision)
        except CommandError as exc:
            raise StoreError(f"the migration to {revision} failed: {exc}") from exc
        rev = current_revision(conn)
        if rev is not None and rev.isdigit():
            conn.execute(text("UPDATE store_meta SET value = :v WHERE key = 'schema_version'"), {"v": str(int(rev))})
        return rev


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-sqlite-ddl"]:
        sys.exit("usage: python -m graphdeck.store.migrate --write-sqlite-ddl")
    SQLITE_DDL_FILE.write_text(render_sqlite_ddl())
    print(f"wrote {SQLITE_DDL_FILE}")
