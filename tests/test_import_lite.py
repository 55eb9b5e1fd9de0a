"""``graphdeck import`` into SQLite without SQLAlchemy (NOTE: [SQLite store without SQLAlchemy] in
store/lite.py): the generated DDL is the schema's, and a store written through ``sqlite3`` holds
the same rows, table by table, as one created and written through SQLAlchemy."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from graphdeck.errors import NotAStoreError, StoreFullError
from graphdeck.store import lite, migrate, sqlite_ddl
from graphdeck.store.torch_trace import import_torch_trace
from graphdeck.store.torch_trace_rows import EngineWriter, SqliteWriter, open_writer
from tests.conftest import shared_path

DDP = ("data", "torch_trace", "generated_torch2.13_cpu_gloo", "ddp")
RUNTIME = ("data", "torch_trace", "tlparse_tests", "inputs", "multi_rank_runtime")
TIMES = ("created_at", "started_at")  # the clock at writing: differs between any two imports


def _dump(path) -> dict:
    """Every table's rows (time columns left out) ordered by their first column, and the schema
    objects SQLite holds (``sqlite_master``)."""
    conn = sqlite3.connect(path)
    out = {"sqlite_master": sorted(conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall())}
    for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})") if r[1] not in TIMES]
        names = ", ".join(f'"{c}"' for c in cols)
        out[table] = conn.execute(f"SELECT {names} FROM {table} ORDER BY 1").fetchall()
    conn.close()
    return out


def test_generated_ddl_is_the_schemas():
    """store/sqlite_ddl.py is what ``python -m graphdeck.store.migrate --write-sqlite-ddl`` writes
    from store/schema.py now (regenerate it after a schema change)."""
    assert (migrate.SQLITE_DDL_FILE.read_text() == migrate.render_sqlite_ddl()), \
        "store/sqlite_ddl.py is stale: run python -m graphdeck.store.migrate --write-sqlite-ddl"
    assert sqlite_ddl.REVISION == migrate.head_revision()


@pytest.mark.parametrize("folder", [DDP, RUNTIME], ids=["ddp-2-ranks", "multi_rank_runtime-7-ranks"])
def test_sqlite3_store_equals_sqlalchemy_store(tmp_path, folder):
    """The same logs imported twice into new stores, through SQLAlchemy (``open_engine``:
    ``create_all`` + Alembic's stamp; rows on a SQLAlchemy connection) and through ``sqlite3``
    (a path: the generated DDL; rows on sqlite3): the same schema objects and, table by table,
    the same rows (ids included)."""
    from graphdeck.store.db import open_engine

    logs = shared_path(*folder)
    engine = open_engine(tmp_path / "sa.db")
    a = import_torch_trace(engine, logs, run_name="r")
    engine.dispose()
    b = import_torch_trace(str(tmp_path / "lite.db"), logs, run_name="r")
    assert a.to_dict() == b.to_dict()
    sa, li = _dump(tmp_path / "sa.db"), _dump(tmp_path / "lite.db")
    assert sa.keys() == li.keys()
    for table in sa:
        assert sa[table] == li[table], f"table {table} differs"
    assert len(li["nodes"]) == a.stats["nodes"] > 0 and len(li["graphs"]) == a.stats["graphs"]
    conn = sqlite3.connect(tmp_path / "lite.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert (tmp_path / "lite.db").stat().st_mode & 0o077 == 0, "a new store is its owner's only"


def test_current_store_opens_without_sqlalchemy_and_older_ones_are_migrated(tmp_path):
    from sqlalchemy import create_engine

    from graphdeck.store.db import open_engine, store_url

    logs = shared_path(*DDP)
    store = tmp_path / "s.db"
    import_torch_trace(str(store), logs, run_name="one")
    w = open_writer(str(store))
    assert isinstance(w, SqliteWriter), "a store at the head is written through sqlite3"
    w.close()
    import_torch_trace(str(store), logs, run_name="two")
    assert _dump(store)["runs"][1][1] == "two"
    # a store one revision behind: opened (and upgraded) through SQLAlchemy, then written
    old = tmp_path / "old.db"
    raw = create_engine(store_url(old))
    migrate.upgrade(raw, migrate.revision_of(sqlite_ddl.SCHEMA_VERSION - 1))
    raw.dispose()
    w = open_writer(str(old))
    assert isinstance(w, EngineWriter), "an older store goes through open_engine"
    w.close()
    import_torch_trace(str(old), logs, run_name="one")
    assert _dump(old)["alembic_version"] == [(sqlite_ddl.REVISION,)]
    assert len(_dump(old)["nodes"]) == len(_dump(store)["nodes"]) // 2
    open_engine(old, read_only=True).dispose()  # current now


def test_not_a_store_and_full_store_errors(tmp_path, monkeypatch):
    logs = shared_path(*DDP)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(NotAStoreError):
        import_torch_trace(str(junk), logs, run_name="r")
    monkeypatch.setenv(lite.MAX_BYTES_ENV, str(400 * 1024))
    with pytest.raises(StoreFullError):
        import_torch_trace(str(tmp_path / "small.db"), logs, run_name="r")


def test_cli_import_loads_no_sqlalchemy(tmp_path):
    """`graphdeck import` of TORCH_TRACE logs into a SQLite store imports neither SQLAlchemy nor
    the ORM schema (its start-up cost was ~0.3 s CPU of a 2-rank import)."""
    store = tmp_path / "b.db"
    probe = ("import sys\nfrom graphdeck.cli import main\n"
             f"try:\n    main(['import', {str(shared_path(*DDP))!r}, '--store', {str(store)!r}, '--run', 'b',"
             " '--no-progress'])\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
             "print('@@', sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'alembic', 'numpy')"
             " or m == 'graphdeck.store.schema'))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "@@ []" in proc.stdout, proc.stdout[-2000:]
    assert "44 graphs, 662 nodes" in proc.stdout, proc.stdout
