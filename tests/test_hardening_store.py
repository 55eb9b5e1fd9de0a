"""Issue 18, "Server and stack on a shared host", items 5 and 6 (store side), over real HTTP against
the real app on SQLite and PostgreSQL: a capture bundle's schema, value types and sizes are
checked before it is merged (a 4xx naming table and column, nothing written, the client does not
retry); runs can be deleted (API with a write token, CLI); trace values that used to answer 500
are counted skips or 4xx; a killed ingest's rows are hidden and swept; run names with ``/`` are
reachable; store files are the owner's only."""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.capture.upload import Uploader, upload_store
from graphdeck.errors import BadInputError
from graphdeck.store.db import open_engine, write_session
from graphdeck.store.schema import Base, Graph, InternedString, Run, Trace, TraceEvent
from tests.conftest import LiveServer

TOKEN = "hardening-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EVENT = {"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}


def trace(*events, **top) -> bytes:
    return json.dumps({"traceEvents": list(events), **top}).encode()


@pytest.fixture
def server(store_url, tmp_path):
    with LiveServer(store_url, write_tokens=(TOKEN,), data_dir=tmp_path / "data") as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
        srv.client, srv.store = c, store_url
        yield srv


def bundle(captured_store: Path, tmp_path: Path, name: str, *sql: str, params=()) -> Path:
    """A copy of the captured store with ``sql`` applied (a hostile or broken bundle)."""
    path = tmp_path / f"{name}.db"
    con = sqlite3.connect(captured_store)
    con.execute("VACUUM INTO ?", (str(path),))
    con.close()
    con = sqlite3.connect(path)
    for i, statement in enumerate(sql):
        con.execute(statement, params[i] if i < len(params) else ())
    con.commit()
    con.close()
    return path


def upload(url: str, path: Path, run: str) -> tuple[dict | None, BadInputError | None, list[str]]:
    """Upload ``path`` as run ``run``; (status, None, retries) or (None, the 4xx error, retries)."""
    retries: list[str] = []
    with Uploader(url, token=TOKEN, attempts=3, backoff_s=0.01, log=retries.append) as up:
        try:
            return up.upload(path, kind="bundle", run=run, rank=0), None, retries
        except BadInputError as exc:
            return None, exc, retries


def run_rows(store: str, run_name: str) -> int:
    """Rows of every table that belong to run ``run_name`` (by run_id, or through its graphs/traces)."""
    engine = open_engine(store, read_only=True)
    try:
        with Session(engine) as s:
            run_id = s.scalar(select(Run.id).where(Run.name == run_name))
            if run_id is None:
                return 0
            graphs = select(Graph.id).where(Graph.run_id == run_id)
            traces = select(Trace.id).where(Trace.run_id == run_id)
            total = 1
            for table in Base.metadata.sorted_tables:
                cols = {c.name for c in table.columns}
                for col, ids in (("run_id", None), ("graph_id", graphs), ("trace_id", traces)):
                    if col in cols:
                        cond = table.c[col] == run_id if ids is None else table.c[col].in_(ids)
                        total += s.scalar(select(func.count()).select_from(table).where(cond))
            return total
    finally:
        engine.dispose()


def get_routes(client: httpx.Client) -> list[dict]:
    """Every GET route of the app, from its OpenAPI document: ``{"path", "query"}``."""
    out = []
    for path, ops in client.get("/openapi.json").json()["paths"].items():
        if "get" in ops:
            query = [p["name"] for p in ops["get"].get("parameters", []) if p.get("in") == "query"]
            out.append({"path": path, "query": query})
    return out


def crawl(client: httpx.Client, run_id: int) -> dict[str, int]:
    """Status of every GET route for this run's first graph, node and trace."""
    run = client.get(f"/api/runs/{run_id}").json()
    graph = run["graphs"][0]["id"]
    other = run["graphs"][-1]["id"]
    trace_id = run["traces"][0]["id"] if run["traces"] else 0
    node = client.get(f"/api/graphs/{graph}/nodes").json()[1]["name"]
    values = {"run_id": str(run_id), "run_name": str(run_id), "graph_id": str(graph), "other_id": str(other),
              "trace_id": str(trace_id), "node_name": quote(node, safe=""), "kind": "bytes", "event_id": "1",
              "upload_id": "0" * 32}
    out = {}
    for route in get_routes(client):
        url = route["path"]
        for key, value in values.items():
            url = url.replace("{" + key + "}", value)
        out[url] = client.get(url).status_code
    return out


# ---------------------------------------------------------------------------- item 5: bundles


BROKEN = {
    # (what, SQL, table, column)
    "computed column": (("ALTER TABLE edges DROP COLUMN size_bytes",
                         "ALTER TABLE edges ADD COLUMN size_bytes TEXT GENERATED ALWAYS AS "
                         "(printf('%.*c', 2000000, 'x')) VIRTUAL"), "edges", "size_bytes"),
    "missing column": (("ALTER TABLE graph_io DROP COLUMN desc",), "graph_io", "desc"),
    "text in an integer": (("UPDATE graphs SET rank = 'r'",), "graphs", "rank"),
    "blob in a text": (("UPDATE nodes SET name = X'00ff' WHERE id = (SELECT min(id) FROM nodes)",), "nodes", "name"),
    "boolean 7": (("UPDATE params SET requires_grad = 7",), "params", "requires_grad"),
    "infinite float": (("UPDATE graphs SET compile_time_s = 9e999",), "graphs", "compile_time_s"),
    "bad date": (("UPDATE runs SET created_at = 'yesterday'",), "runs", "created_at"),
    "not JSON": (("UPDATE graphs SET meta_json = '{nope'",), "graphs", "meta_json"),
    "JSON not an object": (("UPDATE runs SET meta_json = '[1, 2]'",), "runs", "meta_json"),
    "JSON 600 deep": (("UPDATE nodes SET args_json = ? WHERE id = (SELECT min(id) FROM nodes)",), "nodes", "args_json"),
    "NULL where required": (("CREATE TABLE nodes_copy AS SELECT * FROM nodes", "DROP TABLE nodes",  # no NOT NULL
                             "ALTER TABLE nodes_copy RENAME TO nodes",
                             "UPDATE nodes SET op = NULL WHERE id = (SELECT max(id) FROM nodes)"), "nodes", "op"),
    "int past 32 bits": (("UPDATE nodes SET idx = 4294967296 WHERE id = (SELECT max(id) FROM nodes)",), "nodes", "idx"),
    "not UTF-8": (("UPDATE graphs SET name = CAST(X'61ff62' AS TEXT)",), "graphs", None),
}


def test_bundle_schema_types_and_sizes_are_checked_before_merging(server, captured_store, tmp_path):
    """Each broken bundle is a 400 naming its table and column, at once (no retry), and leaves
    nothing; the same capture unbroken still merges, and every read endpoint of it answers."""
    for what, (sql, table, column) in BROKEN.items():
        params = [("[" * 600 + "]" * 600,)] if what == "JSON 600 deep" else ()
        path = bundle(captured_store, tmp_path, what.replace(" ", "_"), *sql, params=params)
        status, err, retries = upload(server.url, path, f"broken {what}")
        assert err is not None, f"{what}: accepted ({status and status.get('result')})"
        assert err.details.get("http_status") == 400, f"{what}: {err.message}"
        assert table in err.message and (column is None or column in err.message), f"{what}: {err.message}"
        assert not retries, f"{what}: the client retried a permanent answer: {retries}"
        assert run_rows(server.store, f"broken {what}") == 0, f"{what}: rows were written"
    status, err, _ = upload(server.url, bundle(captured_store, tmp_path, "good"), "good")
    assert err is None, err
    run_id = status["result"]["run_id"]
    assert status["result"]["rows"]["nodes"] > 100 and status["result"]["rows"]["trace_events"] > 100
    bad = {url: code for url, code in crawl(server.client, run_id).items() if code >= 500}
    assert not bad, bad


def test_postgres_refuses_what_it_cannot_hold_naming_the_column(server, captured_store, tmp_path):
    """A graph name past its 300 characters or NUL in a node name: 400 naming the column on
    PostgreSQL (which cannot hold them); SQLite keeps them as they are."""
    cases = {"long graph name": ("UPDATE graphs SET name = ?", ("g" * 301,), "graphs", "name"),
             "NUL in a node name": ("UPDATE nodes SET name = name || ?", ("\x00x",), "nodes", "name")}
    pg = "://" in server.store
    for what, (sql, params, table, column) in cases.items():
        path = bundle(captured_store, tmp_path, what.replace(" ", "_"), sql, params=[params])
        status, err, retries = upload(server.url, path, what)
        if pg:
            assert err is not None and err.details.get("http_status") == 400, what
            assert f"{table}, column {column}" in err.message, err.message
            assert not retries
        else:
            assert err is None, f"{what}: {err}"


# ---------------------------------------------------------------------------- item 5: deleting runs


def test_delete_run_over_the_api_and_the_cli(server, captured_store, tmp_path):
    c = server.client
    good = bundle(captured_store, tmp_path, "good")
    first = upload_store(server.url, good, run="doomed", rank=0, token=TOKEN)["result"]
    assert c.post("/api/runs/doomed/traces", content=trace(EVENT, {**EVENT, "ts": 5})).status_code == 201
    upload_store(server.url, good, run="kept", rank=0, token=TOKEN)
    kept_before = run_rows(server.store, "kept")
    assert run_rows(server.store, "doomed") > 1000

    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        assert anonymous.delete("/api/runs/doomed").status_code == 401, "a delete is a write: it needs the token"
    assert c.delete("/api/runs/no-such-run").status_code == 404
    r = c.delete("/api/runs/doomed")
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    for table in ("runs", "ranks", "params", "graphs", "nodes", "edges", "graph_io", "traces", "trace_events",
                  "compile_events", "upload_markers"):
        assert rows.get(table), f"{table} not deleted: {rows}"
    assert run_rows(server.store, "doomed") == 0, "every row of the run is gone"
    assert run_rows(server.store, "kept") == kept_before, "the other run is untouched"
    assert c.get("/api/runs/doomed").status_code == 404
    assert c.get(f"/api/graphs/{first['created']['graphs'][0]}").status_code == 404
    again = upload_store(server.url, good, run="doomed", rank=0, token=TOKEN)["result"]
    assert not again["already_merged"] and again["run_id"] != first["run_id"], "the same file merges anew"

    cli = [sys.executable, "-m", "graphdeck.cli", "delete-run", str(server.store)]
    done = subprocess.run([*cli, "--run", "kept"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "deleted run 'kept'" in done.stdout and "nodes" in done.stdout
    assert run_rows(server.store, "kept") == 0
    unknown = subprocess.run([*cli, "--run", "kept"], capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and "not found" in unknown.stderr


# ---------------------------------------------------------------------------- item 6b: 500s → 4xx


def test_trace_values_that_answered_500_are_counted_or_refused(server):
    c = server.client
    memory = {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "s": "t",
              "args": {"Device Type": 1, "Device Id": 0, "Bytes": 10, "Total Allocated": 100, "Total Reserved": 200}}
    bad_memory = [{**memory, "ts": 3, "args": {**memory["args"], "Bytes": "lots"}},
                  {**memory, "ts": 4, "args": {**memory["args"], "Total Allocated": [1]}},
                  {**memory, "ts": 5, "args": "not an object"}]
    deep = trace({**EVENT, "args": {"x": "P"}}).replace(b'"P"', b"[" * 340 + b"]" * 340)
    deeper = trace({**EVENT, "args": {"x": "P"}}).replace(b'"P"', b'{"a":' * 480 + b"1" + b"}" * 480)
    cases = {
        "ts 1e308": (trace(EVENT, {**EVENT, "ts": 1e308}), 1),
        "dur 1.7e308": (trace(EVENT, {**EVENT, "dur": 1.7e308}), 1),
        "ts -1e308 in the exact reader": (b'{"traceEvents": [' + json.dumps(EVENT).encode() +
                                          b', {"ph": "X", "name": "a", "ts": -1e308, "dur": 1, "pid": 1, "tid": 1}]}', 1),
        "args 340 deep": (deep, 0),
        "args 480 deep": (deeper, 0),
        "non-numeric memory events": (trace(EVENT, {**memory, "ts": 6}, *bad_memory), 3),
    }
    for what, (body, skipped) in cases.items():
        r = c.post(f"/api/runs/{quote(what)}/traces", content=body)
        assert r.status_code == 201, f"{what}: {r.status_code} {r.text[:300]}"
        stats = r.json()["stats"]
        assert stats["skipped_bad_event"] == skipped and stats["stored"] == stats["events_total"] - skipped, what
        trace_id = r.json()["trace_id"]
        for suffix in ("", "/timeline", "/window?t0_ms=0&t1_ms=1", "/analysis", "/memory"):
            got = c.get(f"/api/traces/{trace_id}{suffix}")
            assert got.status_code < 500, f"{what} {suffix}: {got.status_code} {got.text[:200]}"
    r = c.get(f"/api/traces/{trace_id}/memory")
    assert r.status_code == 200 and r.json()["1:0"]["total_allocated_bytes"] == [100], "the good event is kept"

    # A rank past 64 bits, on every route taking one: never a 500 (a 4xx, or nothing found).
    run_id = c.get("/api/runs").json()[0]["id"]
    routes = [rt for rt in get_routes(c) if "rank" in rt["query"]]
    assert len(routes) >= 3
    for route in routes:
        url = route["path"].replace("{run_id}", str(run_id))
        for rank in (2**63, 2**64, -(2**63) - 1):
            got = c.get(url, params={"rank": rank})
            assert got.status_code < 500, f"{url}?rank={rank}: {got.status_code} {got.text[:200]}"
            if route["path"] == "/api/runs/{run_id}/graphs":
                assert got.status_code == 422, f"{url}?rank={rank}: {got.status_code}"
    assert c.get(f"/api/graphs/{2**63}").status_code in (400, 404, 422)


def test_odd_run_names_are_4xx_or_kept(server):
    """NUL or more than 200 characters in a run name: kept on SQLite, a 400 naming ``runs.name``
    on PostgreSQL (which cannot hold them); looking such a name up is a 404 on both."""
    c = server.client
    pg = "://" in server.store
    for name in ("nul\x00name", "n" * 201):
        r = c.post(f"/api/runs/{quote(name)}/traces", content=trace(EVENT))
        if pg:
            assert r.status_code == 400 and "runs.name" in r.json()["error"], r.text
        else:
            assert r.status_code == 201, r.text
    assert c.get(f"/api/runs/{quote('other' + chr(0))}").status_code == 404
    assert c.get(f"/api/runs/{'m' * 400}").status_code == 404


# ---------------------------------------------------------------------------- item 6c: killed ingests


def _ingesting_trace(store: str, run: str, age_s: float) -> int:
    """A trace as an ingest killed mid-way leaves it: status ``ingesting``, some events (memory
    events among them), created ``age_s`` ago."""
    engine = open_engine(store)
    try:
        with write_session(engine) as s:
            run_row = s.scalar(select(Run).where(Run.name == run)) or Run(name=run, meta_json="{}")
            s.add(run_row)
            s.flush()
            name = s.scalar(select(InternedString).where(InternedString.value == "[memory]")) or \
                InternedString(value="[memory]")
            s.add(name)
            s.flush()
            created = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=age_s)
            t = Trace(run_id=run_row.id, rank=0, name=f"killed {age_s}", status="ingesting", created_at=created)
            s.add(t)
            s.flush()
            for i in range(50):
                s.add(TraceEvent(trace_id=t.id, ph="i", name_id=name.id, ts_ns=i * 1000, dur_ns=0, pid="1", tid="1",
                                 args_json=json.dumps({"Device Type": 1, "Device Id": 0, "Bytes": 8,
                                                       "Total Allocated": 8 * i})))
            return t.id
    finally:
        engine.dispose()


def test_killed_ingest_is_hidden_and_swept_at_start(store_url, tmp_path, monkeypatch):
    open_engine(store_url).dispose()
    dead = _ingesting_trace(store_url, "killed", age_s=7200)
    live = _ingesting_trace(store_url, "killed", age_s=1)
    monkeypatch.setenv("GRAPHDECK_STALE_INGEST_S", "600")
    monkeypatch.setenv("GRAPHDECK_STALE_PROBE_S", "0.2")
    with LiveServer(store_url, data_dir=tmp_path / "data") as srv, httpx.Client(base_url=srv.url) as c:
        r = c.get(f"/api/traces/{live}/memory")  # its [memory] events are not served while it is written
        assert r.status_code == 404 and "ingesting" in r.json()["error"], r.text
        assert c.get(f"/api/traces/{dead}/memory").status_code == 404, "hidden, or swept already"
        engine = open_engine(store_url, read_only=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with Session(engine) as s:
                    left = set(s.scalars(select(Trace.id)))
                    events = s.scalar(select(func.count()).select_from(TraceEvent).where(TraceEvent.trace_id == dead))
                if dead not in left:
                    break
                time.sleep(0.1)
        finally:
            engine.dispose()
        assert dead not in left and events == 0, "the dead writer's trace and events were swept at start"
        assert live in left, "a recent ingest (its writer may be alive) is left alone"


# ---------------------------------------------------------------------------- item 6e: '/' in run names


def test_run_names_with_a_slash_are_reachable_by_name(server, captured_store, tmp_path):
    c = server.client
    name = "team/exp 1"
    run_id = upload_store(server.url, bundle(captured_store, tmp_path, "slash"), run=name, rank=0,
                          token=TOKEN)["result"]["run_id"]
    for ref in (quote(name, safe=""), "team~2Fexp~201"):
        r = c.get(f"/api/runs/{ref}")
        assert r.status_code == 200 and r.json()["id"] == run_id, f"{ref}: {r.status_code} {r.text[:200]}"
        graphs = c.get(f"/api/runs/{ref}/graphs")
        assert graphs.status_code == 200 and graphs.json(), ref
    assert c.get("/api/runs/team~2Fexp~202").status_code == 404
    assert c.delete(f"/api/runs/{quote(name, safe='')}").status_code == 200
    assert c.get(f"/api/runs/{run_id}").status_code == 404


# ---------------------------------------------------------------------------- item 6g: file modes


def test_store_files_are_created_readable_by_their_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "private.db"
        engine = open_engine(path)
        with write_session(engine) as s:
            s.add(Run(name="r", meta_json="{}"))
        with engine.connect() as conn:  # the WAL and its index exist while a connection is open
            conn.exec_driver_sql("SELECT 1").all()
            files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
            assert all(f.exists() for f in files)
            modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
        engine.dispose()
        assert modes == {f.name: 0o600 for f in files}, modes
        with LiveServer(tmp_path / "served.db"):
            assert stat.S_IMODE((tmp_path / "served.db").stat().st_mode) == 0o600
    finally:
        os.umask(old)
