"""The store under several writers: real processes, one SQLite file in WAL mode."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from graphdeck.errors import StoreError
from graphdeck.store.db import open_engine
from graphdeck.store.schema import SCHEMA_VERSION, Edge, Graph, Node, Rank, Run, StoreMeta

WRITER = r"""
import sys, torch
from graphdeck.capture.fxrecord import record_graph
from graphdeck.capture.writer import StoreWriter
store, rank, world, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gm = torch.fx.symbolic_trace(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)]))
rec = record_graph(gm)
w = StoreWriter(store, "shared", rank, world)
for i in range(count):
    w.write_graph(rec, kind="dynamo", name=f"g{i}", compile_id=f"{i}/0")
    print(i, flush=True)
"""


def test_ranks_writing_at_once_lose_no_rows(tmp_path):
    store, world, per_rank = tmp_path / "s.db", 4, 25
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(store), str(r), str(world), str(per_rank)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    with Session(open_engine(store, read_only=True)) as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 1, "every rank joined the same run"
        assert sorted(s.scalars(select(Rank.rank))) == list(range(world))
        for r in range(world):
            graphs = s.scalars(select(Graph).where(Graph.rank == r)).all()
            assert len(graphs) == per_rank, f"rank {r}: {per_rank} graphs written, {len(graphs)} stored"
            assert sorted(g.ordinal for g in graphs) == list(range(per_rank))
        nodes_per_graph = 6 + 2  # 6 linears + input placeholder + output
        assert s.scalar(select(func.count()).select_from(Node)) == world * per_rank * nodes_per_graph
        assert s.scalar(text("PRAGMA journal_mode")) == "wal"


def test_a_rank_killed_mid_write_leaves_no_half_graph(tmp_path):
    store = tmp_path / "s.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store), "0", "1", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(30):  # let it write some graphs, then kill it without warning
        proc.stdout.readline()
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    with Session(open_engine(store)) as s:
        graphs = s.scalars(select(Graph)).all()
        assert len(graphs) >= 30
        for g in graphs:
            stored = s.scalar(select(func.count()).select_from(Node).where(Node.graph_id == g.id))
            edges = s.scalar(select(func.count()).select_from(Edge).where(Edge.graph_id == g.id))
            assert stored == g.num_nodes == 8 and edges == 7, f"graph {g.id} is complete or absent"
        orphans = s.scalar(select(func.count()).select_from(Node).where(Node.graph_id.not_in(select(Graph.id))))
        assert orphans == 0


def test_store_of_another_schema_version_is_refused(tmp_path):
    store = tmp_path / "s.db"
    engine = open_engine(store)
    with Session(engine) as s, s.begin():
        s.get(StoreMeta, "schema_version").value = str(SCHEMA_VERSION + 1)
    try:
        open_engine(store, read_only=True)
    except StoreError as exc:
        assert "schema version" in exc.message
    else:
        raise AssertionError("a store of a newer schema must be refused with StoreError")


def test_read_only_engine_cannot_write(tmp_path):
    store = tmp_path / "s.db"
    open_engine(store)
    ro = open_engine(store, read_only=True)
    with ro.connect() as conn:
        try:
            conn.execute(text("INSERT INTO strings (value) VALUES ('x')"))
        except Exception as exc:
            assert "readonly" in str(exc).lower() or "query_only" in str(exc).lower() or "read-only" in str(exc).lower()
        else:
            raise AssertionError("the server's engine is read-only (PRAGMA query_only)")


def test_a_file_that_is_no_store_is_bad_input_for_every_gate(tmp_path):
    """A CI gate given a broken artifact exits 2 (bad input) naming it, never 1 (a check FAILed)."""
    import gzip
    import sqlite3

    from click.testing import CliRunner

    from graphdeck.cli import main

    files = {"text.db": b"hello\n", "random.db": bytes(range(256)) * 20, "empty.db": b"",
             "store.db.gz": gzip.compress(b"SQLite format 3\0" + bytes(200))}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    other = sqlite3.connect(tmp_path / "other.db")
    other.execute("CREATE TABLE t (a)")
    other.commit()
    other.close()
    (tmp_path / "folder").mkdir()
    runner = CliRunner()
    for name in [*files, "other.db", "folder"]:
        path = str(tmp_path / name)
        for args in (["check-grads", path, "--run", "r"], ["check-ranks", path, "--run", "r"],
                     ["check-compile", path, "--run", "r"], ["diff-runs", path, "a", "b"], ["summary", "r", "--store", path]):
            r = runner.invoke(main, args)
            assert r.exit_code == 2 and "not a graphdeck store" in r.output, (args, r.exit_code, r.output)
