"""The store on PostgreSQL: the same capture, ingest and read routes as on SQLite.

One real capture (conftest's ``TINY_SCRIPT``: a 1-layer GPT-2 under ``aot_eager`` with a profiled
step, so Dynamo/AOT graphs, parameters, compile records and a Kineto trace ingested by the real
ingest) is written by the real Agent into a fresh PostgreSQL database, and the real app is served
over it; every read route must answer as it does for the SQLite capture of the same script.
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.store.db import get_or_create_run, open_engine, write_session
from graphdeck.store.schema import Graph, Node, Run, Trace, TraceEvent
from tests.conftest import TINY_SCRIPT, LiveServer, run_python


def test_open_engine_creates_and_reads_back(store_url):
    engine = open_engine(store_url)
    with write_session(engine) as s:
        get_or_create_run(s, "r1", world_size=2)
    reader = open_engine(store_url, read_only=True)
    with Session(reader) as s:
        assert s.scalars(select(Run.name)).all() == ["r1"], "the run written is read back"
    engine.dispose()
    reader.dispose()


def test_read_only_engine_refuses_writes(store_url):
    open_engine(store_url).dispose()
    reader = open_engine(store_url, read_only=True)
    with pytest.raises(Exception) as info, write_session(reader) as s:
        get_or_create_run(s, "nope")
    assert "read" in str(info.value).lower(), f"a read-only store refuses writes: {info.value}"
    reader.dispose()


@pytest.fixture(scope="module")
def pg_captured(pg_server) -> str:
    """Run ``tiny`` captured by the real Agent into its own PostgreSQL database."""
    from graphdeck.pg_local import create_database

    url = create_database(pg_server, "captured_tiny")
    run_python(TINY_SCRIPT, url)
    return url


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request):
    store = request.getfixturevalue("captured_store" if request.param == "sqlite" else "pg_captured")
    with LiveServer(store) as srv:
        yield request.param, store, srv


def _counts(store) -> dict:
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == "tiny"))
        out = {
            "graphs": s.scalar(select(func.count()).select_from(Graph).where(Graph.run_id == run_id)),
            "nodes": s.scalar(select(func.count()).select_from(Node).join(Graph).where(Graph.run_id == run_id)),
            "traces_ok": s.scalar(select(func.count()).select_from(Trace)
                                  .where(Trace.run_id == run_id, Trace.status == "ok")),
            "events": s.scalar(select(func.count()).select_from(TraceEvent).join(Trace)
                               .where(Trace.run_id == run_id)),
        }
    engine.dispose()
    return out


def test_capture_and_ingest_write_the_same_rows_on_both(captured_store, pg_captured):
    sqlite, pg = _counts(captured_store), _counts(pg_captured)
    assert sqlite["graphs"] > 0 and sqlite["events"] > 0, f"the SQLite capture has graphs and trace events: {sqlite}"
    assert pg == sqlite, f"the same capture script writes the same rows to PostgreSQL ({pg}) as to SQLite ({sqlite})"


def _get(client: httpx.Client, url: str):
    r = client.get(url)
    assert r.status_code == 200, f"GET {url}: {r.status_code} {r.text[:500]}"
    return r


def test_every_read_route_answers(served):
    backend, _store, srv = served
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        runs = _get(c, "/api/runs").json()
        names = [r["name"] for r in (runs["runs"] if isinstance(runs, dict) else runs)]
        assert "tiny" in names, f"{backend}: run tiny listed: {names}"
        for path in ("/api/runs/tiny", "/api/runs/tiny/ranks", "/api/runs/tiny/graphs",
                     "/api/runs/tiny/compile-events", "/api/runs/tiny/gradients",
                     "/api/runs/tiny/rank-consistency", "/api/runs/tiny/timeline",
                     "/api/runs/tiny/compile-index", "/api/runs/tiny/collectives",
                     "/api/runs/tiny/summary/ranks", "/api/runs/tiny/summary/ranks",  # computed, then kept
                     "/api/runs/tiny/heatmap", "/api/runs/tiny/rank-index?heatmap=step_time"):
            _get(c, path)
        graphs = _get(c, "/api/runs/tiny/graphs").json()
        graphs = graphs["graphs"] if isinstance(graphs, dict) else graphs
        assert graphs, f"{backend}: the run has graphs"
        for g in graphs:
            gid = g["id"]
            for path in ("", "/nodes", "/view", "/svg", "/memory", "/counterparts", "/kernels", "/node-times"):
                _get(c, f"/api/graphs/{gid}{path}")
        fw = next(g for g in graphs if g["kind"] == "aot_forward")
        node = _get(c, f"/api/graphs/{fw['id']}/nodes").json()
        node = (node["nodes"] if isinstance(node, dict) else node)[-1]["name"]
        _get(c, f"/api/graphs/{fw['id']}/nodes/{node}")
        run = _get(c, "/api/runs/tiny").json()
        traces = run.get("traces") or _get(c, "/api/runs/tiny").json().get("traces", [])
        assert traces, f"{backend}: run tiny has its profiled trace: {list(run)}"
        for t in traces:
            for path in ("", "/timeline", "/window", "/analysis"):
                _get(c, f"/api/traces/{t['id']}{path}")


def test_torch_trace_import_and_gradient_check(store_url):
    """TORCH_TRACE import (store/torch_trace_build's bulk inserts) and the gradient check's raw SQL
    give the same verdicts on both backends: detach/ cuts blk2's gradient on both ranks."""
    from graphdeck.analysis.gradients.core import gradient_report
    from graphdeck.store.torch_trace import import_torch_trace
    from tests.conftest import shared_path

    logs = shared_path("data", "torch_trace", "generated_torch2.13_cpu_gloo", "detach")
    engine = open_engine(store_url)
    import_torch_trace(engine, logs, run_name="detach", strict=True)
    with Session(open_engine(store_url, read_only=True)) as s:
        rep = gradient_report(s, s.scalar(select(Run).where(Run.name == "detach")))
    bad = sorted((p.rank, p.fqn, p.status) for p in rep.params if p.status != "OK")
    assert bad == [(r, f, "NO_GRAD") for r in (0, 1) for f in ("blk2.bias", "blk2.weight")], bad
    assert rep.summary["OK"] == 16, rep.summary
    engine.dispose()


def test_unreachable_server_is_a_store_error_without_the_password():
    pytest.importorskip("psycopg")
    from graphdeck.errors import StoreError

    with pytest.raises(StoreError) as info:
        open_engine("postgresql://alice:s3cret-pw@127.0.0.1:1/graphdeck")
    msg = info.value.message
    assert "127.0.0.1" in msg and "s3cret-pw" not in msg and "***" in msg, f"names the server, hides the password: {msg}"


def test_settings_repr_hides_the_store_password():
    from graphdeck.server.settings import Settings

    shown = repr(Settings(store="postgresql+psycopg://alice:s3cret-pw@db:5432/graphdeck"))
    assert "s3cret-pw" not in shown and "alice:***@db:5432/graphdeck" in shown, shown
