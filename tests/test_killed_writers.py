"""Writers killed with SIGKILL at a declared seam (issue 36, item 7), and what they leave:

* a Kineto ingest killed mid-trace (its input is a pipe that stops half-way): the server's next
  read of the runs removes the half-written trace at once (its writer ran on this host and is
  gone: NOTE: [Writer stamps]), not 30 minutes later at a server start; the run row the ingest
  made, now holding nothing, is listed as ``state: empty`` with a note, not as a healthy run;
* ``graphdeck import`` killed between two ranks (``tests/programs/killed_import.py`` holds before
  the second log): while it lives a second import of the run is refused; once it is dead the
  same command run again replaces the half-imported rank and stores what a clean import stores
  (before: "run already has rank(s) [0]" for ever).

Real parts: SQLite stores in tmp dirs, real subprocesses, the real CLI, the app over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.store.db import get_or_create_run, open_engine, write_session
from graphdeck.store.schema import Graph, Node, Rank, Trace, TraceEvent
from tests.conftest import REPO, LiveServer, shared_path

INGEST = r"""
import sys
from graphdeck.store.db import open_engine
from graphdeck.store.traces import ingest_trace
ingest_trace(open_engine(sys.argv[1]), sys.stdin.buffer, run_name="killed", rank=0, name="half", batch_size=50)
"""
LOGS = ("data", "torch_trace", "generated_torch2.13_cpu_gloo", "detach")


def _trace(n: int) -> bytes:
    events = [{"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 7}", "ts": i * 10, "dur": 5, "pid": 1, "tid": 1}
              for i in range(n)]
    return json.dumps({"traceEvents": events}).encode()


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _count(store, model, *where) -> int:
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        n = s.scalar(select(func.count()).select_from(model).where(*where)) or 0
    engine.dispose()
    return n


def test_a_killed_ingest_is_swept_on_the_next_read_and_its_empty_run_is_said(tmp_path):
    store = tmp_path / "s.db"
    open_engine(store).dispose()
    proc = subprocess.Popen([sys.executable, "-c", INGEST, str(store)], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    data = _trace(4000)
    try:
        proc.stdin.write(data[: len(data) // 2])  # half the trace; then the writer waits for more
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _count(store, TraceEvent):
            time.sleep(0.2)
        assert _count(store, TraceEvent), "the ingest stored some batches before it was killed"
        _kill(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _count(store, Trace, Trace.status == "ingesting") == 1, "the killed ingest left its trace half-written"

    with LiveServer(store) as srv:
        runs = httpx.get(f"{srv.url}/api/runs", timeout=60).json()
        run = httpx.get(f"{srv.url}/api/runs/killed", timeout=60).json()
    assert _count(store, Trace) == 0 and _count(store, TraceEvent) == 0, (
        "the dead writer's trace and its events are gone on the first read, no 30-minute wait")
    (listed,) = [r for r in runs if r["name"] == "killed"]
    assert listed["state"] == "empty" and "killed before its first write" in listed["note"], listed
    assert run["state"] == "empty" and run["traces"] == [], run


def _import(store, run, folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphdeck.cli", "import", str(folder), "--store", str(store),
                           "--run", run], capture_output=True, text=True, timeout=600)


def _shape(store, run_name) -> dict:
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        from graphdeck.store.schema import Run

        run_id = s.scalar(select(Run.id).where(Run.name == run_name))
        out = {"ranks": sorted(s.scalars(select(Rank.rank).where(Rank.run_id == run_id))),
               "graphs": s.scalar(select(func.count()).select_from(Graph).where(Graph.run_id == run_id)),
               "nodes": s.scalar(select(func.count()).select_from(Node).join(Graph, Node.graph_id == Graph.id)
                                 .where(Graph.run_id == run_id)),
               "stamped": [r for r, m in s.execute(select(Rank.rank, Rank.meta_json).where(Rank.run_id == run_id))
                           if '"writer"' in (m or "")]}
    engine.dispose()
    return out


def test_a_killed_import_is_replaced_by_running_it_again(tmp_path):
    folder = shared_path(*LOGS)
    clean = tmp_path / "clean.db"
    done = _import(clean, "job", folder)
    assert done.returncode == 0, done.stderr[-3000:]
    want = _shape(clean, "job")
    assert want["ranks"] == [0, 1] and want["graphs"] and not want["stamped"], want

    store = tmp_path / "s.db"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/programs/killed_import.py"), str(folder),
                             "--store", str(store), "--run", "job"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "holding", proc.stderr.read()[-3000:]
        half = _shape(store, "job")
        assert half["ranks"] == [0] and half["stamped"] == [0], half
        busy = _import(store, "job", folder)
        assert busy.returncode == 2 and "already has rank(s) [0]" in busy.stderr and (
            f"rank 0 is being imported by pid {proc.pid}" in busy.stderr), (
            "a live import's ranks are not replaced", busy.stderr[-2000:])
        _kill(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    again = _import(store, "job", folder)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "replaced rank(s) [0] left half-imported by a killed import" in again.stderr, again.stderr
    assert f"pid {proc.pid}" in again.stderr, again.stderr
    assert _shape(store, "job") == want, "the same rows as a clean import, no rank twice, no stamp left"
    assert os.path.exists(store)


@pytest.mark.browser
def test_the_runs_page_says_a_run_is_empty(tmp_path, browser):
    store = tmp_path / "s.db"
    engine = open_engine(store)
    with write_session(engine) as s:
        get_or_create_run(s, "left-empty")
    engine.dispose()
    with LiveServer(store) as srv:
        page = browser.new_page()
        page.goto(f"{srv.url}/#/runs")
        cell = page.wait_for_selector("#runs-table .run-empty")
        assert "killed before its first write" in cell.inner_text()
        page.close()
