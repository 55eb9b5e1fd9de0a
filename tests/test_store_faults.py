"""Faults: a rank SIGKILLed mid-write, and a full disk (SQLite size quota): the store stays
consistent, readers and the API never see half a graph or half a trace, and the error says what
happened.

Real processes are killed with SIGKILL inside a real transaction (``tests/programs/store_writers.py
--hold-s`` stops inside its third graph's transaction after flushing its rows; the trace ingest
reads from a pipe that stops mid-file). The full disk is SQLite's ``max_page_count`` quota
(``open_engine(max_bytes=...)`` / ``$GRAPHDECK_STORE_MAX_BYTES``): the same ``SQLITE_FULL`` a full
filesystem gives, without mounting one (CI may run in a container). On PostgreSQL the disk is
really full: the test database's tables live in a tablespace on a 2 MiB tmpfs (SQLSTATE 53100;
skipped, saying why, where a tmpfs cannot be mounted).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from graphdeck.errors import StoreFullError
from graphdeck.store.db import Interner, get_or_create_run, open_engine, write_session
from graphdeck.store.schema import Graph, Node, Run, Trace, TraceEvent
from tests.conftest import REPO, LiveServer, shared_path

NODES_PER_GRAPH = 19  # Block in tests/programs/store_writers.py


def _graph_rows(store) -> tuple[int, list[tuple[int, int]]]:
    """(graphs, [(num_nodes, nodes actually stored) per graph]) read through a read-only engine."""
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        rows = s.execute(select(Graph.num_nodes, func.count(Node.id)).outerjoin(Node, Node.graph_id == Graph.id)
                         .group_by(Graph.id, Graph.num_nodes)).all()
    engine.dispose()
    return len(rows), [tuple(r) for r in rows]


def _wait_for(proc: subprocess.Popen, word: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if word in line:
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"the writer never printed {word!r}: {proc.stderr.read()[-3000:] if proc.stderr else ''}")


def test_rank_killed_mid_graph_leaves_no_half_graph(store_url):
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/programs/store_writers.py"), store_url, "1", "5",
                             "--hold-s", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(proc, "holding")
        # Inside the third graph's transaction, its rows flushed: readers see the first two only.
        n, rows = _graph_rows(store_url)
        assert n == 2 and all(a == b == NODES_PER_GRAPH for a, b in rows), (
            f"while a graph is being written, readers see only the committed ones, whole: {rows}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    n, rows = _graph_rows(store_url)
    assert n == 2 and all(a == b == NODES_PER_GRAPH for a, b in rows), f"after SIGKILL: two whole graphs: {rows}"
    engine = open_engine(store_url)  # the dead rank's lock is gone: a restarted rank writes on
    with write_session(engine) as s:
        get_or_create_run(s, "after-the-kill")
        if s.get_bind().dialect.name == "sqlite":
            assert s.scalar(text("PRAGMA integrity_check")) == "ok", "the SQLite file is intact"
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(Node).where(Node.graph_id.not_in(select(Graph.id)))) == 0, \
            "no orphan nodes"
    engine.dispose()
    with LiveServer(store_url) as srv:
        graphs = httpx.get(f"{srv.url}/api/runs/writers/graphs", timeout=60).json()
    assert [g["name"] for g in graphs] == ["rank0_graph0", "rank0_graph1"], graphs


INGEST = r"""
import sys
from graphdeck.store.db import open_engine
from graphdeck.store.traces import ingest_trace
ingest_trace(open_engine(sys.argv[1]), sys.stdin.buffer, run_name="faults", rank=0, name="killed", batch_size=200)
"""


def test_ingest_killed_mid_trace_is_hidden(store_url):
    trace_file = shared_path("data", "traces", "deepseek-profile-data", "train.json")
    proc = subprocess.Popen([sys.executable, "-c", INGEST, store_url], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    data = trace_file.read_bytes()
    try:
        proc.stdin.write(data[: len(data) // 2])  # half the file, then the writer waits for more
        proc.stdin.flush()
        deadline = time.monotonic() + 240
        stored = 0
        while time.monotonic() < deadline and not stored:
            time.sleep(0.5)
            try:
                engine = open_engine(store_url, read_only=True)
            except Exception:  # noqa: BLE001 - the ingest has not created the store yet
                continue
            with Session(engine) as s:
                stored = s.scalar(select(func.count()).select_from(TraceEvent)) or 0
            engine.dispose()
        assert stored, "the ingest stored some batches before it was killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    engine = open_engine(store_url, read_only=True)
    with Session(engine) as s:
        trace = s.scalars(select(Trace)).one()
        assert trace.status == "ingesting", f"the killed ingest's trace stays marked unfinished: {trace.status}"
    engine.dispose()
    with LiveServer(store_url) as srv:
        run = httpx.get(f"{srv.url}/api/runs/faults", timeout=60).json()
        by_id = httpx.get(f"{srv.url}/api/traces/{trace.id}", timeout=60)
        timeline = httpx.get(f"{srv.url}/api/traces/{trace.id}/timeline", timeout=60)
    assert run["traces"] == [] and run["num_traces"] == 0, f"the run lists no half-written trace: {run['traces']}"
    # hidden while 'ingesting', or already swept: its writer ran on this host and is dead (NOTE: [Writer stamps])
    assert by_id.status_code == 404, by_id.text
    assert timeline.status_code == 404, f"no timeline of half a trace: {timeline.status_code}"


# ---------------------------------------------------------------------------- disk full (SQLite quota)


def test_quota_full_graph_write_is_rolled_back_with_a_clear_error(tmp_path):
    path = tmp_path / "quota.db"
    open_engine(path).dispose()
    engine = open_engine(path, max_bytes=400 * 1024)
    written = 0
    with pytest.raises(StoreFullError) as info:
        for i in range(10_000):
            with write_session(engine) as s:
                run = get_or_create_run(s, "full")
                g = Graph(run_id=run.id, rank=0, ordinal=i, kind="dynamo", name=f"g{i}", num_nodes=50,
                          code="x" * 2000)
                s.add(g)
                s.flush()
                intern = Interner(s)
                s.add_all([Node(graph_id=g.id, idx=j, name=f"n{j}", op="call_function",
                                target_id=intern(f"op{i}_{j}"), args_json="[" + "1," * 100 + "1]")
                           for j in range(50)])
            written += 1
    msg = info.value.message
    assert "store is full" in msg and "quota" in msg and "disk full" in msg, f"the error says what happened: {msg}"
    assert info.value.status_code == 507
    engine.dispose()
    assert written > 0, "some graphs fit under the quota"
    n, rows = _graph_rows(path)
    assert n == written and all(a == b == 50 for a, b in rows), (
        f"{written} whole graphs stored; the one that hit the quota left nothing: {rows[-3:]}")


def test_quota_full_trace_ingest_fails_clearly_and_is_hidden(tmp_path):
    trace_file = shared_path("data", "traces", "deepseek-profile-data", "train.json")
    store = tmp_path / "quota.db"
    open_engine(store).dispose()
    env = dict(os.environ, GRAPHDECK_STORE_MAX_BYTES=str(600 * 1024))
    proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "ingest-trace", str(trace_file), "--store",
                           str(store), "--run", "full", "--rank", "0"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, f"exit 1 (store error): {proc.returncode}\n{proc.stderr[-2000:]}"
    assert "store is full" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    with LiveServer(store) as srv:
        runs = httpx.get(f"{srv.url}/api/runs", timeout=60).json()
    full = [r for r in runs if r["name"] == "full"]
    assert all(r["num_traces"] == 0 for r in full), f"the cut-off trace is not listed: {full}"
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        statuses = s.scalars(select(Trace.status)).all()
        assert "ok" not in statuses, f"no trace claims to be complete: {statuses}"
        assert s.scalar(text("PRAGMA integrity_check")) == "ok"
        assert s.scalar(select(func.count()).select_from(Run)) == 0, "the run the failed ingest made is gone too"
    engine.dispose()


# ---------------------------------------------------------------------------- disk full (PostgreSQL, tiny tmpfs)


@pytest.fixture
def tiny_tablespace(pg_server):
    """A PostgreSQL tablespace on a 2 MiB tmpfs: the database's tables fill a real filesystem.

    Mounting needs root with CAP_SYS_ADMIN (this host has it; a CI container may not: then this
    skips, saying so, and the SQLite quota tests above still cover disk full)."""
    import pwd
    import tempfile

    from graphdeck.pg_local import _run_user

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="graphdeck-pgfull-"))
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): no PostgreSQL disk-full test")
    try:
        user = _run_user() or pwd.getpwuid(os.geteuid()).pw_name
        os.chown(mnt, pwd.getpwnam(user).pw_uid, -1)
        from sqlalchemy import create_engine

        admin = create_engine(pg_server, isolation_level="AUTOCOMMIT")
        name = f"full{os.getpid()}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE TABLESPACE {name} LOCATION '{mnt}'")
            conn.exec_driver_sql(f"CREATE DATABASE {name}")  # the catalog stays on the big disk,
            conn.exec_driver_sql(f"ALTER DATABASE {name} SET default_tablespace = {name}")  # tables go here
        from sqlalchemy.engine import make_url

        yield make_url(pg_server).set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.exec_driver_sql(f"DROP TABLESPACE IF EXISTS {name}")
        admin.dispose()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        mnt.rmdir()


def test_postgres_disk_full_graph_write_is_rolled_back(tiny_tablespace):
    engine = open_engine(tiny_tablespace)
    written = 0
    with pytest.raises(StoreFullError) as info:
        for i in range(10_000):
            with write_session(engine) as s:
                run = get_or_create_run(s, "full")
                g = Graph(run_id=run.id, rank=0, ordinal=i, kind="dynamo", name=f"g{i}", num_nodes=50,
                          code="x" * 2000)
                s.add(g)
                s.flush()
                s.add_all([Node(graph_id=g.id, idx=j, name=f"n{j}", op="call_function",
                                target_id=Interner(s)(f"op{j}"), args_json="[" + "1," * 100 + "1]")
                           for j in range(50)])
            written += 1
    engine.dispose()
    msg = info.value.message
    assert "store is full" in msg and ("No space left" in msg or "could not extend" in msg), msg
    assert written > 0, "some graphs fit on the 2 MiB filesystem"
    n, rows = _graph_rows(tiny_tablespace)
    assert n == written and all(a == b == 50 for a, b in rows), f"{written} whole graphs, nothing of the last: {rows[-3:]}"


def test_upload_into_a_full_store_is_507_and_leaves_no_trace(tmp_path, monkeypatch):
    """End to end: the server's store hits its quota while ingesting an uploaded trace; the client
    gets StoreFullError (HTTP 507, not retried), and the run lists no trace."""
    from graphdeck.capture.upload import upload_trace

    trace_file = shared_path("data", "traces", "deepseek-profile-data", "train.json")
    store = tmp_path / "full.db"
    open_engine(store).dispose()
    monkeypatch.setenv("GRAPHDECK_STORE_MAX_BYTES", str(600 * 1024))
    with LiveServer(store) as srv:
        with pytest.raises(StoreFullError) as info:
            upload_trace(srv.url, trace_file, run="full", rank=0, attempts=2, backoff_s=0.1)
        assert "store is full" in str(info.value), str(info.value)
        one_shot = httpx.post(f"{srv.url}/api/runs/q2/traces?rank=0", content=trace_file.read_bytes(), timeout=300,
                              headers={"X-Graphdeck-Client": "1"})
        assert one_shot.status_code == 507, one_shot.text[:500]
        runs = httpx.get(f"{srv.url}/api/runs", timeout=60).json()
    assert all(r["num_traces"] == 0 for r in runs if r["name"] == "full"), runs
    assert "q2" not in [r["name"] for r in runs], f"a one-shot upload that hit the quota leaves no empty run: {runs}"
