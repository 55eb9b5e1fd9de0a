"""Sixteen rank processes write one store at once: no row lost, no "database is locked".

``tests/programs/store_writers.py`` forks 16 real processes that meet at a barrier and each run
the capture agent's writer (rank registration, parameters, graphs with nodes and edges, compile
records) into a store none of them created yet, so they also race to create the schema; then each
ingests a real Kineto trace (HTA's sampled rank-0 profile) as its own, all at once. Run on
SQLite (one file, WAL, BEGIN IMMEDIATE + busy_timeout) and on PostgreSQL (concurrent writers;
unique-key races on runs/ranks/strings re-run by ``retrying``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from graphdeck.store.db import open_engine
from graphdeck.store.schema import (
    CompileEvent,
    Edge,
    Graph,
    InternedString,
    Node,
    Param,
    Rank,
    Run,
    Trace,
    TraceEvent,
)
from tests.conftest import REPO, LiveServer, shared_path

RANKS = 16
GRAPHS = 6


def test_sixteen_ranks_write_one_store_at_once(store_url):
    trace = shared_path("data", "traces", "hta", "trace_filter", "sampled_rank-0.json.gz")
    proc = subprocess.run([sys.executable, str(REPO / "tests/programs/store_writers.py"), store_url,
                           str(RANKS), str(GRAPHS), "--trace", str(trace)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["errors"] == [], "every rank finished without an error:\n" + "\n".join(report["errors"])
    assert report["exit_codes"] == [0] * RANKS, report
    assert "locked" not in proc.stdout + proc.stderr, "no rank ever saw 'database is locked'"

    n_nodes, n_edges = report["nodes_per_graph"], report["edges_per_graph"]
    engine = open_engine(store_url, read_only=True)
    with Session(engine) as s:
        def count(model, *where):
            return s.scalar(select(func.count()).select_from(model).where(*where))

        assert count(Run) == 1, "16 ranks registering the same run name make one run"
        assert count(Rank) == RANKS, "one row per rank"
        assert count(Graph) == RANKS * GRAPHS, f"{RANKS} ranks x {GRAPHS} graphs, none lost"
        assert count(Node) == RANKS * GRAPHS * n_nodes, f"every graph has its {n_nodes} nodes"
        assert count(Edge) == RANKS * GRAPHS * n_edges, f"every graph has its {n_edges} edges"
        assert count(CompileEvent) == RANKS * GRAPHS, "one compile record per graph"
        assert count(Param) == RANKS * 4, "4 parameters per rank"
        per_rank = dict(s.execute(select(Graph.rank, func.count()).group_by(Graph.rank)).all())
        assert per_rank == {r: GRAPHS for r in range(RANKS)}, per_rank
        ordinals = s.execute(select(Graph.rank, Graph.ordinal).order_by(Graph.rank, Graph.ordinal)).all()
        assert ordinals == [(r, i) for r in range(RANKS) for i in range(GRAPHS)], "capture order kept per rank"
        values = s.scalars(select(InternedString.value)).all()
        assert len(values) == len(set(values)), "each string interned once despite 16 concurrent writers"
        assert s.scalar(text("SELECT count(*) FROM alembic_version")) == 1, "the schema was created once"
        # (the file says distributedInfo.rank 0, which wins over the rank argument: names tell them apart)
        traces = s.execute(select(Trace.name, Trace.status, Trace.num_events)).all()
        assert sorted((name.split("_")[0], st) for name, st, _ in traces) == sorted(
            (f"rank{r}", "ok") for r in range(RANKS)), f"one complete trace per rank: {traces}"
        per_trace = {n for _, _, n in traces}
        assert len(per_trace) == 1 and per_trace.pop() > 0, f"every rank stored the whole trace: {traces}"
        assert count(TraceEvent) == sum(n for _, _, n in traces), "every trace's events are stored, none twice"
    engine.dispose()


UPLOADER = r"""
import sys
from graphdeck.capture.upload import upload_store
status = upload_store(sys.argv[1], sys.argv[2], run=f"job{sys.argv[3]}", rank=0, chunk_bytes=64 * 1024,
                      attempts=20, backoff_s=0.2, log=lambda m: print(m, flush=True))
print("uploaded", status["state"])
"""


def _run_counts(store, run_name: str) -> dict:
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == run_name))
        out = {"graphs": s.scalar(select(func.count()).select_from(Graph).where(Graph.run_id == run_id)),
               "nodes": s.scalar(select(func.count()).select_from(Node).join(Graph).where(Graph.run_id == run_id)),
               "edges": s.scalar(select(func.count()).select_from(Edge).join(Graph).where(Graph.run_id == run_id)),
               "params": s.scalar(select(func.count()).select_from(Param).where(Param.run_id == run_id)),
               "events": s.scalar(select(func.count()).select_from(TraceEvent).join(Trace)
                                  .where(Trace.run_id == run_id))}
    engine.dispose()
    return out


def test_sixteen_uploads_merge_into_postgres_at_once(pg_url, captured_store, tmp_path):
    """16 processes upload a capture bundle each to a server on PostgreSQL at the same time: every
    merge (concurrent transactions interning the same strings) lands whole, none retried twice."""
    expected = _run_counts(captured_store, "tiny")
    env = dict(os.environ, GRAPHDECK_TOKEN="t0k")
    with LiveServer(pg_url, write_tokens=("t0k",), data_dir=tmp_path / "uploads") as srv:
        procs = [subprocess.Popen([sys.executable, "-c", UPLOADER, srv.url, str(captured_store), str(i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for i in range(RANKS)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and "uploaded done" in out, f"uploader {i}:\n{out[-2000:]}"
    for i in range(RANKS):
        assert _run_counts(pg_url, f"job{i}") == expected, f"job{i} has every row of the bundle, once"
