"""Uploads under faults and load, with real processes: the server SIGKILLed mid-upload and
mid-merge then restarted (the upload resumes, the store never shows half of it), and 16 uploader
processes at once (no row lost, no "database is locked")."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from graphdeck.capture.upload import Uploader, snapshot_store
from tests.conftest import LiveServer, free_port

TOKEN = "fault-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRACE_GZ = Path(__file__).parent / "data" / "gpt2_inductor" / "gpt2_rank0.pt.trace.json.gz"
SERVER = r"""
import sys, uvicorn
from graphdeck.server.app import create_app
from graphdeck.server.settings import Settings
app = create_app(Settings(store=sys.argv[1], data_dir=sys.argv[2], write_tokens=(sys.argv[4],)))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
"""


class ServerProcess:
    """The real app in its own process (so it can be SIGKILLed), on a fixed port across restarts."""

    def __init__(self, tmp_path: Path):
        self.store, self.data_dir = tmp_path / "server.db", tmp_path / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(self.store), str(self.data_dir),
                                      str(self.port), TOKEN], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/api/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not answer within 60 s")

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no cleanup runs
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def server_process(tmp_path):
    srv = ServerProcess(tmp_path)
    yield srv
    srv.stop()


def counts(store: Path, run: str) -> dict[str, int]:
    """Rows of ``run`` per table, read as any reader would (committed data only)."""
    con = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        rid = con.execute("SELECT id FROM runs WHERE name = ?", (run,)).fetchone()
        if rid is None:
            return {"runs": 0, "traces": 0, "trace_events": 0, "graphs": 0, "nodes": 0}
        q = {"traces": "SELECT count(*) FROM traces WHERE run_id = ?",
             "trace_events": "SELECT count(*) FROM trace_events JOIN traces t ON t.id = trace_id WHERE t.run_id = ?",
             "graphs": "SELECT count(*) FROM graphs WHERE run_id = ?",
             "nodes": "SELECT count(*) FROM nodes JOIN graphs g ON g.id = graph_id WHERE g.run_id = ?"}
        return {"runs": 1, **{k: con.execute(v, rid).fetchone()[0] for k, v in q.items()}}
    finally:
        con.close()


def test_server_killed_mid_upload_resumes_and_completes(server_process):
    srv = server_process.start()
    data = TRACE_GZ.read_bytes()
    cb = 2048
    spec = {"kind": "trace", "run": "killed", "rank": 0, "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "chunk_bytes": cb}
    with httpx.Client(base_url=srv.url, headers=AUTH) as c:
        uid = c.post("/api/uploads", json=spec).json()["id"]
        for i in range(5):
            c.put(f"/api/uploads/{uid}/chunks/{i}", content=data[i * cb:(i + 1) * cb],
                  headers={"X-Chunk-Sha256": hashlib.sha256(data[i * cb:(i + 1) * cb]).hexdigest()})
    srv.kill()
    # A client uploading through the kill: it backs off while the server is down and resumes.
    log: list[str] = []
    srv.start()
    with httpx.Client(base_url=srv.url, headers=AUTH) as c:
        assert c.get(f"/api/uploads/{uid}").json()["present"] == [0, 1, 2, 3, 4], "chunks survive the kill"
    result: dict = {}

    def client():
        with Uploader(srv.url, token=TOKEN, attempts=30, backoff_s=0.1, max_backoff_s=1.0, log=log.append) as up:
            result.update(up.upload(TRACE_GZ, kind="trace", run="killed", rank=0, chunk_bytes=cb))

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list((srv.data_dir / uid / "chunks").glob("0*"))) < 40:
        time.sleep(0.005)
    srv.kill()
    time.sleep(0.5)
    srv.start()
    t.join(timeout=120)
    assert result.get("state") == "done", (result, log[-5:])
    assert any("retry" in line for line in log), "the kill happened while the client was sending"
    got = counts(srv.store, "killed")
    assert got["traces"] == 1 and got["trace_events"] == result["result"]["num_events"] > 1000, got


def _big_bundle(captured_store: Path, tmp_path: Path) -> tuple[Path, int]:
    """The captured store with its trace events multiplied (so a merge takes a while), gzipped."""
    raw = tmp_path / "big.db"
    con = sqlite3.connect(captured_store)
    con.execute("VACUUM INTO ?", (str(raw),))
    con.close()
    con = sqlite3.connect(raw)
    cols = "trace_id, ph, name_id, cat_id, ts_ns, dur_ns, pid, tid, correlation, args_json"
    while con.execute("SELECT count(*) FROM trace_events").fetchone()[0] < 60_000:
        con.execute(f"INSERT INTO trace_events ({cols}) SELECT {cols} FROM trace_events")
    con.commit()
    events = con.execute("SELECT count(*) FROM trace_events").fetchone()[0]
    con.close()
    return snapshot_store(raw, tmp_path / "big.db.gz"), events


def test_server_killed_mid_merge_shows_all_or_nothing(server_process, captured_store, tmp_path):
    bundle, events = _big_bundle(captured_store, tmp_path)
    srv = server_process.start()
    data = bundle.read_bytes()
    spec = {"kind": "bundle", "run": "merge", "rank": 0, "size_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "chunk_bytes": 1 << 20}
    seen = set()
    for delay_s in (0.4, 1.5):
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
            up = c.post("/api/uploads", json=spec).json()
            for i in up["missing"]:
                piece = data[i * (1 << 20):(i + 1) * (1 << 20)]
                c.put(f"/api/uploads/{up['id']}/chunks/{i}", content=piece,
                      headers={"X-Chunk-Sha256": hashlib.sha256(piece).hexdigest()})
            threading.Thread(target=_post_quietly, args=(f"{srv.url}/api/uploads/{up['id']}/complete",),
                             daemon=True).start()
            time.sleep(delay_s)
        srv.kill()
        got = counts(srv.store, "merge")
        assert got["trace_events"] in (0, events), f"half-merged bundle visible after a kill: {got}"
        seen.add(got["trace_events"])
        srv.start()
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
        r = c.post(f"/api/uploads/{up['id']}/complete")
        assert r.status_code == 200, r.text
    final = counts(srv.store, "merge")
    assert final["trace_events"] == events and final["traces"] == 1, f"merged exactly once: {final}"
    assert final["graphs"] == counts(captured_store, "tiny")["graphs"]


def _post_quietly(url: str) -> None:
    try:
        httpx.post(url, headers=AUTH, timeout=60)
    except httpx.HTTPError:
        pass


UPLOADER = r"""
import sys
from graphdeck.capture.upload import upload_store, upload_trace
url, store, trace, i = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
b = upload_store(url, store, run=f"job{i}", rank=0, chunk_bytes=64 * 1024, attempts=20, backoff_s=0.2)
t = upload_trace(url, trace, run="all", rank=i, chunk_bytes=64 * 1024, attempts=20, backoff_s=0.2)
assert b["state"] == t["state"] == "done", (b, t)
print("ok", b["result"]["run_id"], t["result"]["trace_id"])
"""


def test_sixteen_uploaders_at_once_lose_nothing(captured_store, tmp_path):
    n = 16
    expected = counts(captured_store, "tiny")
    env = dict(os.environ, GRAPHDECK_TOKEN=TOKEN)
    with LiveServer(tmp_path / "server.db", write_tokens=(TOKEN,), data_dir=tmp_path / "data") as srv:
        procs = [subprocess.Popen([sys.executable, "-c", UPLOADER, srv.url, str(captured_store), str(TRACE_GZ), str(i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
                 for i in range(n)]
        outputs = [p.communicate(timeout=400)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and "ok" in out, f"uploader {i} failed:\n{out[-2000:]}"
        assert "database is locked" not in out
    for i in range(n):
        assert counts(tmp_path / "server.db", f"job{i}") == expected, f"run job{i} lost rows"
    got = counts(tmp_path / "server.db", "all")
    con = sqlite3.connect(tmp_path / "server.db")
    per_trace = con.execute("SELECT t.rank, t.num_events, count(e.id) FROM traces t JOIN trace_events e "
                            "ON e.trace_id = t.id JOIN runs r ON r.id = t.run_id WHERE r.name = 'all' "
                            "GROUP BY t.id ORDER BY t.rank").fetchall()
    con.close()
    assert got["traces"] == n and sorted(r for r, _, _ in per_trace) == list(range(n))
    assert all(num == rows for _, num, rows in per_trace), "every trace has all its events"


def test_load_bench_smoke_has_no_errors():
    """bench/bench_load.py for a few seconds: uploads and SVG/timeline reads at once, 0 errors
    (no timing asserted; the numbers are the bench's, in bench/RESULTS.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import bench_load
    finally:
        sys.path.pop(0)
    assert bench_load.main(["--uploaders", "2", "--readers", "2", "--duration-s", "3", "--anchor-s", "1"]) == 0
