"""Alembic migrations of the store: head == schema.py, old stores upgrade with their data, pre-Alembic
stores are adopted, and a store from a newer graphdeck is refused (library, CLI and server)."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.orm import Session

from graphdeck.errors import SchemaVersionError
from graphdeck.store import migrate
from graphdeck.store.db import open_engine, store_url
from graphdeck.store.schema import SCHEMA_VERSION, Base, KernelNode, Run
from tests.conftest import REPO


def _raw(url: str):
    return create_engine(store_url(url))


def test_head_revision_is_schema_version():
    assert migrate.head_revision() == migrate.revision_of(SCHEMA_VERSION), (
        "SCHEMA_VERSION and the newest migration move together (revision '000N' is version N)")


def test_migrations_head_equals_schema_module(store_url):
    """Autogenerate finds nothing to do between the migrated head and schema.py."""
    engine = _raw(store_url)
    assert migrate.upgrade(engine, "head") == migrate.head_revision()
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == [], f"schema.py and the migrations differ (add a revision): {diff}"


def _seed_v1(url: str) -> None:
    """A store at revision 0001 (schema version 1) with a run, a graph, nodes and a kernel link."""
    engine = _raw(url)
    migrate.upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, world_size, created_at, meta_json) "
                          "VALUES (1, 'old-run', 2, '2026-01-01 00:00:00+00:00', '{}')"))
        conn.execute(text("INSERT INTO strings (id, value) VALUES (1, 'aten.mm.default')"))
        conn.execute(text("INSERT INTO graphs (id, run_id, rank, ordinal, kind, name, num_nodes, meta_json) "
                          "VALUES (1, 1, 0, 0, 'aot_forward', 'fw', 1, '{}')"))
        conn.execute(text("INSERT INTO nodes (graph_id, idx, name, op, target_id, args_json, meta_json) "
                          "VALUES (1, 0, 'mm', 'call_function', 1, '[]', '{}')"))
        conn.execute(text("INSERT INTO kernel_nodes (run_id, rank, graph_id, kernel_name, node_name, source) "
                          "VALUES (1, 0, 1, 'triton_mm_0', 'mm', 'seq_nr')"))
    engine.dispose()


def test_old_revision_store_is_upgraded_with_its_data(store_url):
    _seed_v1(store_url)
    with pytest.raises(SchemaVersionError) as info:
        open_engine(store_url, read_only=True)
    assert "older" in info.value.message and "graphdeck db upgrade" in info.value.message, (
        f"a read-only open does not migrate; it says how: {info.value.message}")

    engine = open_engine(store_url)  # a writer migrates
    with Session(engine) as s:
        assert s.scalar(select(Run.name)) == "old-run", "the run survives the upgrade"
        link = s.scalars(select(KernelNode)).one()
        assert (link.kernel_name, link.node_name, link.call_index) == ("triton_mm_0", "mm", None), (
            "the kernel link survives and gets the new nullable column")
        assert s.scalar(text("SELECT version_num FROM alembic_version")) == migrate.revision_of(SCHEMA_VERSION)
        assert s.scalar(text("SELECT value FROM store_meta WHERE key = 'schema_version'")) == str(SCHEMA_VERSION)
    engine.dispose()
    open_engine(store_url, read_only=True).dispose()  # now it opens read-only too


def test_pre_alembic_store_opens_and_is_stamped(tmp_path):
    """The shipped H200 store (written before Alembic: store_meta version 1, call_index added by the
    old ad-hoc ALTER TABLE) reads as it is, and its first read-write open stamps and upgrades it."""
    path = tmp_path / "gpt2.db"
    with gzip.open(REPO / "tests/data/gpt2_inductor/gpt2.db.gz", "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw = _raw(str(path))
    with raw.connect() as conn:
        assert not inspect(conn).has_table("alembic_version"), "the input predates Alembic"
    raw.dispose()

    reader = open_engine(path, read_only=True)
    with Session(reader) as s:
        assert s.scalar(select(Run.name)) == "gpt2", "a pre-Alembic store reads without migrating"
    reader.dispose()

    open_engine(path).dispose()
    raw = _raw(str(path))
    with raw.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision(), "stamped and upgraded to the head"
        assert conn.execute(text("SELECT count(*) FROM kernel_nodes")).scalar() > 0, "its data is kept"
    raw.dispose()


def _make_newer(url: str) -> None:
    open_engine(url).dispose()
    engine = _raw(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    engine.dispose()


def test_newer_store_is_refused_naming_both_versions(store_url):
    _make_newer(store_url)
    for read_only in (False, True):
        with pytest.raises(SchemaVersionError) as info:
            open_engine(store_url, read_only=read_only)
        msg = info.value.message
        assert "99" in msg and f"schema version {SCHEMA_VERSION}" in msg and "newer" in msg, (
            f"the message names the store's version (99) and this graphdeck's ({SCHEMA_VERSION}): {msg}")
    engine = _raw(store_url)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == "0099", "a refused store is left untouched"
    engine.dispose()


def test_server_and_cli_refuse_a_newer_store(tmp_path):
    store = tmp_path / "newer.db"
    _make_newer(str(store))
    from graphdeck.server.app import create_app
    from graphdeck.server.settings import Settings

    with pytest.raises(SchemaVersionError):
        create_app(Settings(store=store))
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "serve", str(store), "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, f"graphdeck serve exits 2 (bad input) on a newer store: {proc.returncode} {proc.stderr}"
    assert "schema version 99" in proc.stderr and f"schema version {SCHEMA_VERSION}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, f"a clear message, not a traceback: {proc.stderr}"
    assert "dashboard" not in proc.stdout, "no dashboard URL is announced for a refused store"
    trace = REPO / "tests/data/gpt2_inductor/gpt2_rank0.pt.trace.json.gz"
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "ingest-trace", str(trace), "--store", str(store),
                           "--run", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "schema version 99" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_cli_db_upgrade(tmp_path):
    store = tmp_path / "old.db"
    _seed_v1(str(store))
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "db", "upgrade", str(store)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"revision {migrate.head_revision()}" in proc.stdout, proc.stdout


def test_pre_alembic_store_without_call_index_is_migrated(tmp_path):
    """A version-1 store from before Alembic *and* before kernel_nodes.call_index: a reader is told
    to migrate it; a writer adopts it at 0001 and upgrades, keeping the kernel link."""
    url = str(tmp_path / "v1.db")
    _seed_v1(url)
    engine = _raw(url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE alembic_version"))
    engine.dispose()
    with pytest.raises(SchemaVersionError, match="older"):
        open_engine(url, read_only=True)
    open_engine(url).dispose()
    with Session(open_engine(url, read_only=True)) as s:
        assert s.scalars(select(KernelNode.kernel_name)).all() == ["triton_mm_0"]


def test_cli_db_errors_are_messages_and_current_reports_what_serve_acts_on(tmp_path):
    """Unknown revision, a newer store, a downgrade: an ``error:`` line, no traceback; ``db
    current`` says a store whose store_meta version alone was bumped is newer (serve refuses it)."""
    from click.testing import CliRunner

    from graphdeck.cli import main

    runner = CliRunner()
    store = str(tmp_path / "s.db")
    r = runner.invoke(main, ["db", "upgrade", store, "--revision", "0099"])
    assert r.exit_code == 2 and "error: revision '0099' is not one" in r.output, r.output
    open_engine(store).dispose()
    r = runner.invoke(main, ["db", "upgrade", store, "--revision", "0001"])
    assert r.exit_code == 2 and "does not downgrade" in r.output, r.output
    engine = _raw(store)
    with engine.begin() as conn:
        conn.execute(text("UPDATE store_meta SET value = '99' WHERE key = 'schema_version'"))
    engine.dispose()
    r = runner.invoke(main, ["db", "current", store])
    assert r.exit_code == 0 and "schema_version 99" in r.output and "newer:" in r.output, r.output
    r = runner.invoke(main, ["db", "upgrade", store, "--revision", migrate.head_revision()])
    assert r.exit_code == 2 and "error: store schema version 99" in r.output, r.output
    assert not any(isinstance(x, Exception) and not isinstance(x, SystemExit) for x in [r.exception]), r.exception


def test_store_older_by_optional_tables_reads_as_it_is(store_url):
    """A schema-2 store (before ``grad_steps``) opens read-only without migrating, and the gradient
    report reads it with no run-time evidence (INCOMPLETE, not an error)."""
    _seed_v1(store_url)
    engine = _raw(store_url)
    migrate.upgrade(engine, "0002")
    engine.dispose()
    reader = open_engine(store_url, read_only=True)
    from graphdeck.analysis.gradients.core import gradient_report

    with Session(reader) as s:
        run = s.scalar(select(Run))
        rep = gradient_report(s, run)
        assert rep.verdict != "PASS"
    reader.dispose()
