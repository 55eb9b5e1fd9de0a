"""Resumable uploads (server/routes/uploads.py) over real HTTP: chunks, retries, resume,
idempotent completion, size limits, gzip bombs, hostile names, and bundles merged whole or not
at all. Inputs: the real H200 trace in tests/data and the session's captured store."""

from __future__ import annotations

import gzip
import hashlib
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from graphdeck.capture.upload import snapshot_store, upload_store, upload_trace
from tests.conftest import LiveServer

TOKEN = "upload-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLIENT = {"X-Graphdeck-Client": "1"}  # graphdeck's clients send it: the server refuses writes a web page could send
TRACE_GZ = Path(__file__).parent / "data" / "gpt2_inductor" / "gpt2_rank0.pt.trace.json.gz"
KiB = 1024


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def create(c: httpx.Client, data: bytes, *, kind="trace", run="job", rank=0, chunk_bytes=64 * KiB, **extra):
    spec = {"kind": kind, "run": run, "rank": rank, "size_bytes": len(data), "sha256": sha(data),
            "chunk_bytes": chunk_bytes, **extra}
    return c.post("/api/uploads", json=spec)


def put(c: httpx.Client, upload_id: str, index: int, data: bytes, digest: str | None = None, **kw):
    return c.put(f"/api/uploads/{upload_id}/chunks/{index}", content=data,
                 headers={"X-Chunk-Sha256": digest or sha(data)}, **kw)


def table_counts(path: Path) -> dict[str, int]:
    con = sqlite3.connect(path)
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' "
                                           "AND name NOT IN ('store_meta', 'strings', 'alembic_version')")]
        return {n: con.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in names}
    finally:
        con.close()


@pytest.fixture
def server(tmp_path):
    with LiveServer(tmp_path / "server.db", write_tokens=(TOKEN,), data_dir=tmp_path / "data") as srv:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
            srv.client = c
            srv.data_dir = tmp_path / "data"
            srv.store = tmp_path / "server.db"
            yield srv


def test_chunks_resume_retry_and_complete_once(server):
    c, data = server.client, TRACE_GZ.read_bytes()
    cb = 64 * KiB
    chunks = [data[i:i + cb] for i in range(0, len(data), cb)]
    r = create(c, data, chunk_bytes=cb, name="rank0.pt.trace.json.gz")
    assert r.status_code == 201, r.text
    up = r.json()
    uid, n = up["id"], up["num_chunks"]
    assert n == len(chunks) and up["missing"] == list(range(n)) and up["state"] == "open"
    again = create(c, data, chunk_bytes=cb, name="rank0.pt.trace.json.gz")
    assert again.status_code == 200 and again.json()["id"] == uid, "declaring the same file again finds it"

    assert put(c, uid, 2, chunks[2]).status_code == 201
    assert put(c, uid, 0, chunks[0]).status_code == 201
    r = put(c, uid, 2, chunks[2])
    assert r.status_code == 200 and r.json()["stored"] is False, "a retried chunk is not stored twice"
    status = c.get(f"/api/uploads/{uid}").json()
    assert status["present"] == [0, 2] and status["missing"] == [i for i in range(n) if i not in (0, 2)]
    assert status["received_bytes"] == len(chunks[0]) + len(chunks[2])
    assert len(list((server.data_dir / uid / "chunks").iterdir())) == 2, "one file per chunk, retry included"

    other = bytes(len(chunks[0]))
    assert put(c, uid, 0, other).status_code == 409, "chunk 0 resent with other bytes"
    r = put(c, uid, 1, chunks[1], digest="0" * 64)
    assert r.status_code == 400 and "sha256" in r.json()["error"], "a corrupted chunk is refused"
    r = put(c, uid, 1, chunks[1] + b"x")
    assert r.status_code == 413, "longer than the chunk (by Content-Length)"
    r = put(c, uid, 1, iter([chunks[1], b"tail"]), digest=sha(chunks[1] + b"tail"))
    assert r.status_code == 413, "longer than the chunk (counted while streaming, no Content-Length)"
    assert put(c, uid, 1, chunks[1][:-1]).status_code == 400, "shorter than the chunk"
    assert put(c, uid, n, b"x").status_code == 404, "no such chunk index"

    r = c.post(f"/api/uploads/{uid}/complete")
    assert r.status_code == 409 and r.json()["missing"] == list(range(1, n))[:1] + list(range(3, n)), r.text
    for i in range(n):
        put(c, uid, i, chunks[i])
    r = c.post(f"/api/uploads/{uid}/complete")
    assert r.status_code == 200, r.text
    done = r.json()["upload"]
    result = done["result"]
    assert done["state"] == "done" and result["status"] == "ok" and result["num_events"] > 1000
    assert result["rank"] == 0 and result["run_name"] == "job"
    again = c.post(f"/api/uploads/{uid}/complete").json()["upload"]
    assert again["result"]["trace_id"] == result["trace_id"], "completing twice ingests once"
    traces = c.get("/api/runs/job").json()
    con = sqlite3.connect(server.store)
    assert con.execute("SELECT count(*) FROM traces").fetchone()[0] == 1, traces
    assert con.execute("SELECT count(*) FROM trace_events").fetchone()[0] == result["num_events"]
    assert not (server.data_dir / uid / "chunks").exists(), "chunks are dropped once ingested"
    assert put(c, uid, 0, chunks[0]).status_code == 409, "a finished upload takes no chunks"
    r = c.get(f"/api/traces/{result['trace_id']}/timeline", params={"limit": 100})
    assert r.status_code == 200 and r.json()["data"], "the uploaded trace is served"


def test_bundle_merges_every_row_once(server, captured_store, tmp_path):
    before = table_counts(captured_store)
    status = upload_store(server.url, captured_store, run="merged", rank=0, token=TOKEN, chunk_bytes=32 * KiB)
    assert status["state"] == "done" and status["num_chunks"] > 1
    after = table_counts(server.store)
    for table, n in before.items():
        assert after.get(table) == n, f"{table}: {after.get(table)} rows on the server, {n} in the bundle"
    again = upload_store(server.url, captured_store, run="merged", rank=0, token=TOKEN)
    assert again["id"] == status["id"] and again["result"] == {**status["result"], "already_merged": True}, \
        "the same upload, answered again (already merged)"
    assert table_counts(server.store) == after, "uploading the same store again merges nothing"
    c = server.client
    graphs = c.get("/api/runs/merged/graphs").json()
    assert len(graphs) == before["graphs"]
    assert c.get(f"/api/graphs/{graphs[-1]['id']}/svg").status_code == 200
    # the same store under another run name: a second, complete copy
    upload_store(server.url, captured_store, run="copy", rank=0, token=TOKEN)
    assert len(c.get("/api/runs/copy/graphs").json()) == before["graphs"]


def test_sizes_are_capped_with_413(tmp_path):
    with LiveServer(tmp_path / "s.db", max_upload_bytes=100 * KiB) as srv, httpx.Client(base_url=srv.url, headers=CLIENT) as c:
        data = TRACE_GZ.read_bytes()
        r = create(c, data)
        assert r.status_code == 413 and "102400-byte limit" in r.json()["error"], r.text
        r = c.post("/api/runs/x/traces", content=data)
        assert r.status_code == 413, "the one-shot trace upload has the same cap"
    with LiveServer(tmp_path / "s2.db", max_upload_bytes=2**60) as srv, httpx.Client(base_url=srv.url, headers=CLIENT) as c:
        spec = {"kind": "bundle", "run": "big", "size_bytes": 100_000 * 2**26, "sha256": "0" * 64, "chunk_bytes": 2**26}
        r = c.post("/api/uploads", json=spec)
        assert r.status_code == 507 and "bytes free" in r.json()["error"], "no room on the upload disk: 507, said so"


def _bomb(inflated_bytes: int) -> bytes:
    body = b'{"traceEvents": [' + b" " * inflated_bytes + b"]}"
    return gzip.compress(body, compresslevel=9)


def test_gzip_bombs_are_refused_with_413(tmp_path):
    with LiveServer(tmp_path / "s.db", max_decompressed_bytes=4 * 1024 * KiB) as srv, \
            httpx.Client(base_url=srv.url, headers=CLIENT) as c:
        bomb = _bomb(8 * 1024 * KiB)
        uid = create(c, bomb, chunk_bytes=len(bomb)).json()["id"]
        put(c, uid, 0, bomb)
        r = c.post(f"/api/uploads/{uid}/complete")
        assert r.status_code == 413 and "4194304 decompressed bytes" in r.json()["error"], r.text
        r = c.post(f"/api/uploads/{uid}/complete")
        assert r.status_code == 413 and c.get(f"/api/uploads/{uid}").json()["state"] == "failed"
        r = c.post("/api/runs/x/traces", content=bomb)
        assert r.status_code == 413 and "decompressed bytes" in r.json()["error"], "the one-shot route too"
        assert c.get("/api/runs").json() == [], "nothing of a bomb is stored"
    with LiveServer(tmp_path / "s2.db") as srv, httpx.Client(base_url=srv.url, headers=CLIENT) as c:
        bomb = _bomb(100 * 1024 * KiB)  # ~100 KiB that inflate 1000x: over the default 200x ratio
        uid = create(c, bomb, chunk_bytes=len(bomb)).json()["id"]
        put(c, uid, 0, bomb)
        r = c.post(f"/api/uploads/{uid}/complete")
        assert r.status_code == 413 and "ratio of 200" in r.json()["error"], r.text


HOSTILE_RUNS = ["../../etc/passwd", "<script>alert(1)</script>\"'", "x'; DROP TABLE runs;--", "run/../../x",
                "名前 ünïcode", "%2e%2e%2f", "a" * 200, "\\..\\..\\windows"]


def test_hostile_names_never_become_paths(server):
    c, data = server.client, TRACE_GZ.read_bytes()
    for i, run in enumerate(HOSTILE_RUNS):
        r = create(c, data, run=run, chunk_bytes=len(data), name=f"../../../../tmp/evil{i}.json")
        assert r.status_code == 201, (run, r.text)
        uid = r.json()["id"]
        assert put(c, uid, 0, data).status_code == 201
        r = c.post(f"/api/uploads/{uid}/complete")
        assert r.status_code == 200, (run, r.text)
        if "/" not in run:  # a "/" in a path segment is a path separator to the router
            got = c.get(f"/api/runs/{quote(run, safe='')}")
            assert got.status_code == 200 and got.json()["name"] == run, (run, got.text)
    names = {r["name"] for r in c.get("/api/runs").json()}
    assert names == set(HOSTILE_RUNS), "every hostile run name is stored as data, unchanged"
    for path in server.data_dir.rglob("*"):
        rel = path.relative_to(server.data_dir).parts
        assert len(rel[0]) == 32 and all(ch in "0123456789abcdef" for ch in rel[0]), rel
    for bad in ({"run": "a\x00b"}, {"run": "x" * 10_000}, {"run": ""}, {"name": "n" * 1000}, {"kind": "../x"},
                {"sha256": "../../" + "0" * 58}, {"size_bytes": -1}, {"chunk_bytes": 0}):
        spec = {"kind": "trace", "run": "ok", "rank": 0, "size_bytes": len(data), "sha256": sha(data),
                "chunk_bytes": 1024, **bad}
        r = c.post("/api/uploads", json=spec)
        assert r.status_code == 422 and r.json()["ok"] is False, (bad, r.text)
    for uid in ("../../etc/passwd", "..%2F..%2Fetc", "0" * 31 + "g", "0" * 33):
        assert c.get(f"/api/uploads/{uid}").status_code in (404, 422), uid


def _bundle_with(tmp_path, captured_store, name: str, sql: str) -> bytes:
    path = tmp_path / name
    path.unlink(missing_ok=True)
    con = sqlite3.connect(captured_store)
    con.execute("VACUUM INTO ?", (str(path),))
    con.close()
    con = sqlite3.connect(path)
    con.executescript(sql)
    con.commit()
    con.close()
    return path.read_bytes()


def test_bad_bundles_are_refused_and_leave_nothing(server, captured_store, tmp_path):
    c = server.client
    cases = {
        "not sqlite": b"SQLite format 3\x00" + b"\x00" * 5000,
        "two runs": _bundle_with(tmp_path, captured_store, "two.db", "INSERT INTO runs (name, meta_json, created_at) VALUES ('b', '{}', '2026-01-01 00:00:00');"),
        "dangling reference": _bundle_with(tmp_path, captured_store, "dangling.db",
                                           "PRAGMA foreign_keys=OFF; UPDATE trace_events SET name_id = 999999 "
                                           "WHERE id = (SELECT max(id) FROM trace_events);"),
        "newer schema": _bundle_with(tmp_path, captured_store, "newer.db",
                                     "UPDATE store_meta SET value = '999' WHERE key = 'schema_version';"),
    }
    for what, data in cases.items():
        uid = create(c, data, kind="bundle", run=f"bad {what}", chunk_bytes=len(data)).json()["id"]
        assert put(c, uid, 0, data).status_code == 201
        r = c.post(f"/api/uploads/{uid}/complete")
        assert r.status_code == 400, (what, r.text)
        assert c.get(f"/api/uploads/{uid}").json()["state"] == "failed"
    assert table_counts(server.store).get("graphs", 0) == 0, "no half-merged bundle: the last table failed"
    assert c.get("/api/runs").json() == []
    # A bundle's triggers never run on the server: they are dropped before it is read.
    trig = _bundle_with(tmp_path, captured_store, "trigger.db",
                        "CREATE TRIGGER t AFTER UPDATE ON runs BEGIN DELETE FROM nodes; END;"
                        "CREATE VIEW v AS SELECT * FROM runs;")
    up = create(c, trig, kind="bundle", run="trig", chunk_bytes=len(trig)).json()
    put(c, up["id"], 0, trig)
    assert c.post(f"/api/uploads/{up['id']}/complete").status_code == 200
    assert table_counts(server.store)["nodes"] == table_counts(captured_store)["nodes"]


def test_upload_client_reports_server_errors(server, tmp_path):
    from graphdeck.errors import GraphdeckError, UsageError

    with pytest.raises(UsageError, match="401"):
        upload_trace(server.url, TRACE_GZ, run="x", token="", attempts=2, backoff_s=0.01)
    with pytest.raises(UsageError, match="403"):
        upload_trace(server.url, TRACE_GZ, run="x", token="wrong", attempts=2, backoff_s=0.01)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"nope": 1}')
    with pytest.raises(GraphdeckError, match="400"):
        upload_trace(server.url, bad, run="x", token=TOKEN, attempts=2, backoff_s=0.01)
    ok = upload_trace(server.url, TRACE_GZ, run="cli", token=TOKEN, chunk_bytes=100 * KiB)
    assert ok["result"]["status"] == "ok"


def test_snapshot_is_deterministic(captured_store, tmp_path):
    a = snapshot_store(captured_store, tmp_path / "a.db.gz").read_bytes()
    b = snapshot_store(captured_store, tmp_path / "b.db.gz").read_bytes()
    assert a == b, "same store, same bytes: the upload id repeats and a re-upload is recognised"


def test_uploads_into_postgres(pg_url, captured_store, tmp_path):
    """The same merge and trace ingest with PostgreSQL as the server's store."""
    from sqlalchemy import create_engine, text

    before = table_counts(captured_store)
    with LiveServer(pg_url, write_tokens=(TOKEN,), data_dir=tmp_path / "data") as srv:
        b = upload_store(srv.url, captured_store, run="pg", rank=0, token=TOKEN, chunk_bytes=64 * KiB)
        t = upload_trace(srv.url, TRACE_GZ, run="pg", rank=1, token=TOKEN, chunk_bytes=64 * KiB)
        again = upload_trace(srv.url, TRACE_GZ, run="pg", rank=1, token=TOKEN)
        assert again["result"] == {**t["result"], "already_merged": True}, \
            "a repeated trace upload is answered from the store, not ingested again"
        graphs = httpx.get(f"{srv.url}/api/runs/pg/graphs").json()
        assert httpx.get(f"{srv.url}/api/graphs/{graphs[0]['id']}/svg").status_code == 200
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        for table in ("graphs", "nodes", "edges", "params", "graph_io", "compile_events"):
            assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar() == before[table], table
        assert conn.execute(text("SELECT count(*) FROM traces")).scalar() == before["traces"] + 1
        assert conn.execute(text("SELECT count(*) FROM trace_events")).scalar() == \
            before["trace_events"] + t["result"]["num_events"]
    engine.dispose()
    assert b["state"] == "done"
    from click.testing import CliRunner

    from graphdeck.cli import main

    r = CliRunner().invoke(main, ["demo", "--store", pg_url, "--run-name", "pg", "--no-serve"])
    assert r.exit_code == 2 and "already holds a run named 'pg'" in r.output, "demo never appends to a database run"


def test_abandoned_uploads_are_swept_and_done_ones_stay_ingested_once(server):
    from graphdeck.server.upload_area import UploadArea

    c, data = server.client, TRACE_GZ.read_bytes()
    abandoned = create(c, data, run="abandoned", chunk_bytes=64 * KiB).json()["id"]
    put(c, abandoned, 0, data[:64 * KiB])
    done = upload_trace(server.url, TRACE_GZ, run="swept", rank=0, token=TOKEN)
    area = UploadArea(server.data_dir)  # the server's folder, swept as the server does on a create
    assert area.sweep(3600) == [], "nothing is older than an hour"
    removed = area.sweep(3600, now=time.time() + 7200)
    assert sorted(removed) == sorted([abandoned, done["id"]]) and not any(server.data_dir.iterdir())
    assert c.get(f"/api/uploads/{abandoned}").status_code == 404
    again = upload_trace(server.url, TRACE_GZ, run="swept", rank=0, token=TOKEN)
    assert again["result"]["already_merged"] is True, "the store remembers a swept upload"
    con = sqlite3.connect(server.store)
    assert con.execute("SELECT count(*) FROM traces t JOIN runs r ON r.id = t.run_id "
                       "WHERE r.name = 'swept'").fetchone()[0] == 1
    con.close()


def test_graphdeck_upload_cli(server, captured_store, tmp_path):
    from click.testing import CliRunner

    from graphdeck.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["upload", str(TRACE_GZ), "--url", server.url, "--run", "cli", "--rank", "3",
                             "--token", TOKEN, "--chunk-mb", "1"])
    assert r.exit_code == 0, r.output
    assert "as trace" in r.output and "'cli'" in r.output
    r = runner.invoke(main, ["upload", str(captured_store), "--url", server.url, "--run", "cli"],
                      env={"GRAPHDECK_TOKEN": TOKEN})
    assert r.exit_code == 0 and "as bundle" in r.output, r.output
    r = runner.invoke(main, ["upload", str(TRACE_GZ), "--url", server.url, "--run", "cli", "--token", "bad"])
    assert r.exit_code == 2 and "403" in r.output, "a refused token is a usage error naming the answer"
    (tmp_path / "notsqlite.db").write_text("not a database")
    r = runner.invoke(main, ["upload", str(tmp_path / "notsqlite.db"), "--url", server.url, "--run", "cli",
                             "--kind", "bundle", "--token", TOKEN])
    assert r.exit_code == 2 and "error:" in r.output and "not a readable SQLite" in r.output, r.output
    ranks = {x["rank"] for x in server.client.get("/api/runs/cli/ranks").json()}
    assert ranks == {0, 3}, ranks


def test_done_means_in_this_store_not_in_the_upload_folder(tmp_path):
    """One data dir outliving its store / shared by two stores: "done" comes from the store's own
    marker, so the same file uploaded to two stores lands in both; a failure is not remembered."""
    data_dir, runs = tmp_path / "shared-data", []
    for name in ("a.db", "b.db"):
        with LiveServer(tmp_path / name, write_tokens=(TOKEN,), data_dir=data_dir) as srv:
            first = upload_trace(srv.url, TRACE_GZ, run="both", rank=0, token=TOKEN)
            again = upload_trace(srv.url, TRACE_GZ, run="both", rank=0, token=TOKEN)
            assert first["result"]["already_merged"] is False, name
            assert again["result"]["already_merged"] is True and again["result"]["run_id"] == first["result"]["run_id"]
            runs.append(httpx.get(f"{srv.url}/api/runs").json())
            bad = b'{"nope": 1}'
            with httpx.Client(base_url=srv.url, headers=AUTH) as c:
                uid = create(c, bad).json()["id"]
                put(c, uid, 0, bad)
                assert c.post(f"/api/uploads/{uid}/complete").status_code == 400
                assert create(c, bad).json()["state"] == "open", "declaring it again retries, no cached failure"
    assert [[r["name"] for r in rs] for rs in runs] == [["both"], ["both"]]
    for name in ("a.db", "b.db"):
        con = sqlite3.connect(tmp_path / name)
        assert con.execute("SELECT count(*) FROM traces").fetchone()[0] == 1, name
        con.close()


def test_default_upload_folder_is_per_store():
    from graphdeck.server.routes.uploads import data_dir_for
    from graphdeck.server.settings import Settings

    a = data_dir_for(Settings(store="postgresql+psycopg://u:one@db:5432/a"))
    assert a == data_dir_for(Settings(store="postgresql+psycopg://u:two@db:5432/a")), "the password is no part"
    assert a != data_dir_for(Settings(store="postgresql+psycopg://u:one@db:5432/b"))
    assert "one" not in str(a)


def test_serve_takes_the_upload_limits_from_env_and_options(tmp_path):
    """``graphdeck serve`` reads the operator limits from GRAPHDECK_* (listed in --help) and
    options; a bad value is an error line; the dashboard URL is printed only once bound."""
    import os
    import subprocess
    import sys

    from click.testing import CliRunner

    from graphdeck.cli import main
    from graphdeck.errors import UsageError
    from graphdeck.server import auth
    from graphdeck.stack import wait_healthy
    from tests.conftest import free_port

    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for name in ("GRAPHDECK_STORE", auth.WRITE_TOKENS_ENV, auth.READ_TOKENS_ENV, auth.DATA_DIR_ENV,
                 "GRAPHDECK_STORE_MAX_BYTES", *auth.LIMIT_ENVS):
        assert name in help_text, name
    assert auth.settings_from_env({"GRAPHDECK_UPLOAD_TTL_S": "60", "GRAPHDECK_MAX_DECOMPRESS_RATIO": "10"}) == {
        "write_tokens": (), "read_tokens": (), "upload_ttl_s": 60.0, "max_decompress_ratio": 10.0}
    with pytest.raises(UsageError, match="GRAPHDECK_MAX_UPLOAD_BYTES"):
        auth.settings_from_env({"GRAPHDECK_MAX_UPLOAD_BYTES": "-1"})
    port = free_port()
    env = dict(os.environ, GRAPHDECK_MAX_UPLOAD_BYTES="1000", GRAPHDECK_WRITE_TOKENS=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "graphdeck.cli", "serve", str(tmp_path / "s.db"), "--create", "--port",
                             str(port), "--max-decompressed-bytes", "5000"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/api/health", timeout_s=60, proc=proc)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH) as c:
            r = create(c, b"x" * 2000)
            assert r.status_code == 413 and "1000" in r.json()["error"], r.text
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert out.count("dashboard: http://") == 1, out
