"""The N-way rank diff at many ranks (issue 42; NOTE: [N-way rank diff] in analysis/ranks/nway.py)
and the merged graph it draws (NOTE: [Merged N-way graph] in analysis/graphs/merge.py).

The stores are generated as bench/bench_nway.py (after bench/bench_ranks.py) makes them: real FX graphs recorded by the
capture's own ``record_graph`` and written by its ``StoreWriter`` for rank 0 and the odd rank (whose
one graph has ``aten.gelu`` where the others have ``aten.relu``), the other ranks' identical rows
copied in SQL — what a real capture would have written. Real SQLite in a temp dir.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from bench.bench_nway import generated_store
from graphdeck.analysis.graphs.diff import diff_views
from graphdeck.analysis.graphs.merge import merge_views
from graphdeck.analysis.graphs.view import GraphView, ViewEdge, ViewNode
from graphdeck.analysis.ranks.nway import nway_report, nway_reports
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run
from tests.conftest import REPO


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[int, Path]:
    d = tmp_path_factory.mktemp("nway_scale")
    return {n: generated_store(d / f"r{n}.db", n, odd=n - 3) for n in (8, 64)}


def _node_queries(store: Path, fn) -> tuple[object, int]:
    """``fn(session, run)``'s result and how many SQL statements it ran that read ``nodes`` rows."""
    engine = open_engine(store, read_only=True)
    count = [0]

    def seen(_conn, _cursor, statement, *_a):
        if "FROM nodes" in statement:
            count[0] += 1

    event.listen(engine, "before_cursor_execute", seen)
    with Session(engine) as s:
        out = fn(s, s.scalars(select(Run).where(Run.name == "bench")).one())
    engine.dispose()
    return out, count[0]


def test_many_identical_ranks_and_one_odd_group_by_fingerprint(stores):
    """64 ranks, rank 61's graph 1 differs: two classes, the odd node named with the odd rank as
    'target aten.relu.default vs aten.gelu.default'; graph 0 is one class. The nodes are read per
    distinct graph, not per rank: as many node queries at 64 ranks as at 8."""
    rep, n64 = _node_queries(stores[64], lambda s, run: nway_report(s, run, "1/0:aot_forward", times=False))
    assert rep.verdict == "FAIL" and rep.exit_code == 1
    assert [(c.status, c.ranks) for c in rep.classes] == [("base", [r for r in range(64) if r != 61]),
                                                          ("differs", [61])]
    assert len(rep.classes[0].fingerprints) == 1  # 63 identical ranks: one fingerprint
    (node,) = rep.nodes
    (d,) = node.differs
    assert d.ranks == [61] and d.kind == "replaced" and d.status == "differs"
    assert d.detail == "target aten.relu.default vs aten.gelu.default"
    assert node.mark == "changed" and rep.marks() == {node.id: "changed"}
    assert f"node {node.id}: ranks 61 differ: target aten.relu.default vs aten.gelu.default" in rep.to_text()
    _rep8, n8 = _node_queries(stores[8], lambda s, run: nway_report(s, run, "1/0:aot_forward", times=False))
    assert n64 == n8, (n64, n8)

    same, n_same = _node_queries(stores[64], lambda s, run: nway_report(s, run, "0/0:aot_forward", times=False))
    assert same.verdict == "OK" and len(same.classes) == 1 and same.classes[0].ranks == list(range(64))
    assert same.nodes == [] and n_same <= 1  # the base graph's view only

    # Leaving the odd rank out: every rank agrees; basing on it: the other 63 differ.
    assert _node_queries(stores[64], lambda s, run: nway_report(s, run, "1", ranks="0-60,62-63",
                                                                times=False))[0].verdict == "OK"
    based = _node_queries(stores[64], lambda s, run: nway_report(s, run, "1/0:aot_forward", base_rank=61,
                                                                 times=False))[0]
    assert based.base_rank == 61 and based.classes[1].ranks == [r for r in range(64) if r != 61]


def test_every_graph_of_a_run_and_the_cli(stores, tmp_path):
    """Without --graph every key is compared; text and --json; exit 1 differ, 0 agree, 2 bad input."""
    reports, _ = _node_queries(stores[64], lambda s, run: nway_reports(s, run))
    assert [(r.key, r.verdict) for r in reports] == [("0/0:aot_forward:0", "OK"), ("1/0:aot_forward:0", "FAIL")]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "graphdeck.cli", "diff-ranks", str(stores[64]), "--run", "bench",
                               *args], capture_output=True, text=True, timeout=300, cwd=REPO)

    p = cli()
    assert p.returncode == 1, p.stderr
    assert "ranks 61 differ: target aten.relu.default vs aten.gelu.default" in p.stdout
    assert "FAIL: ranks differ (1 of 2 graphs differ)" in p.stdout
    p = cli("--graph", "1/0:aot_forward", "--json")
    assert p.returncode == 1
    doc = json.loads(p.stdout)
    assert doc["verdict"] == "FAIL" and doc["classes"][1]["ranks"] == [61]
    assert cli("--ranks", "0-60,62-63").returncode == 0
    for bad in (["--graph", "9/9:nope"], ["--ranks", "0-99"], ["--ranks", "x"], ["--base", "3"]):
        p = cli(*bad)
        assert p.returncode == 2 and p.stderr.startswith("error: "), (bad, p.stdout, p.stderr)


def _view(nodes: list[tuple[str, str]], edges: list[tuple[str, str]]) -> GraphView:
    return GraphView(graph_id=1, name="g", kind="dynamo", nodes=[
        ViewNode(id=n, idx=i, label=n, op="placeholder" if t == "x" else "output" if t == "output" else "call_function",
                 target=t, category="other") for i, (n, t) in enumerate(nodes)],
        edges=[ViewEdge(src=a, dst=b) for a, b in edges])


def test_merge_views_replaced_absent_added_and_shared():
    """Base x → mm → relu → out. Version 1: bmm in mm's place (replaced); version 2: tanh added
    after relu; version 3: the same tanh added, relu gone. The shared tanh is one merged node."""
    base = _view([("x", "x"), ("mm", "aten.mm.default"), ("relu", "aten.relu.default"), ("out", "output")],
                 [("x", "mm"), ("mm", "relu"), ("relu", "out")])
    v1 = _view([("x", "x"), ("bmm", "aten.bmm.default"), ("relu", "aten.relu.default"), ("out", "output")],
               [("x", "bmm"), ("bmm", "relu"), ("relu", "out")])
    v2 = _view([("x", "x"), ("mm", "aten.mm.default"), ("relu", "aten.relu.default"), ("tanh", "aten.tanh.default"),
                ("out", "output")], [("x", "mm"), ("mm", "relu"), ("relu", "tanh"), ("tanh", "out")])
    v3 = _view([("x", "x"), ("mm", "aten.mm.default"), ("tanh", "aten.tanh.default"), ("out", "output")],
               [("x", "mm"), ("mm", "tanh"), ("tanh", "out")])
    merged = merge_views(base, [(f"r{i}", v, diff_views(base, v)) for i, v in enumerate((v1, v2, v3), 1)])
    ch = {k: [(c.version, c.kind, c.detail) for c in v] for k, v in merged.changes.items()}
    assert ch["mm"] == [(0, "replaced", "target aten.mm.default vs aten.bmm.default")]
    assert (2, "replaced", "target aten.relu.default vs aten.tanh.default") in ch["relu"]
    assert ch["tanh"] == [(1, "added", "aten.tanh.default added")]
    assert [n.id for n in merged.view.nodes] == ["x", "mm", "relu", "tanh", "out"]
    assert merged.view.nodes[3].idx == 4  # past the base's last idx
    assert ("relu", "tanh") in {(e.src, e.dst) for e in merged.view.edges}
    assert merged.names[0]["bmm"] == "mm" and merged.names[1]["tanh"] == "tanh"


def test_the_same_view_on_postgresql(stores, pg_url):
    """The 8-rank store merged into PostgreSQL (store/merge.py, as an uploaded rank bundle is): the
    same classes, node and verdict as on SQLite."""
    from graphdeck.store.merge import merge_store

    engine = open_engine(pg_url)
    merge_store(stores[8], engine, run_name="bench")
    with Session(engine) as s:
        rep = nway_report(s, s.scalars(select(Run).where(Run.name == "bench")).one(), "1/0:aot_forward", times=False)
    engine.dispose()
    assert rep.verdict == "FAIL" and [c.ranks for c in rep.classes] == [[0, 1, 2, 3, 4, 6, 7], [5]]
    assert [d.detail for n in rep.nodes for d in n.differs] == ["target aten.relu.default vs aten.gelu.default"]


def test_a_graph_only_some_ranks_compiled_warns_and_a_bare_rank_is_incomplete(stores, tmp_path):
    """Rank 0 alone compiled graph 2/0: the others are a ``missing`` class (WARN, exit 0: a compile
    some ranks made, which check-ranks judges). A rank that stored no graph at all: INCOMPLETE."""
    import sqlite3

    from graphdeck.capture.fxrecord import record_graph
    from graphdeck.capture.writer import StoreWriter
    from bench.bench_ranks import build_graph

    path = tmp_path / "extra.db"
    with sqlite3.connect(stores[8]) as a, sqlite3.connect(path) as b:
        a.backup(b)
    w = StoreWriter(path, "bench", 0, 9, backend="gloo")
    w.write_graph(record_graph(build_graph(4)), kind="aot_forward", name="extra", compile_id="2/0")
    w.engine.dispose()
    rep = _node_queries(path, lambda s, run: nway_report(s, run, "2/0:aot_forward", times=False))[0]
    assert rep.verdict == "WARN" and rep.exit_code == 0, rep.to_text()
    assert [(c.status, c.ranks) for c in rep.classes] == [("base", [0]), ("missing", list(range(1, 8)))]
    StoreWriter(path, "bench", 8, 9, backend="gloo").engine.dispose()  # rank 8: registered, no graph
    rep = _node_queries(path, lambda s, run: nway_report(s, run, "1/0:aot_forward", times=False))[0]
    assert rep.verdict == "FAIL"  # rank 5 still differs
    rep = _node_queries(path, lambda s, run: nway_report(s, run, "0/0:aot_forward", times=False))[0]
    assert rep.verdict == "INCOMPLETE" and rep.exit_code == 3
    assert rep.missing_evidence == ["ranks [8] stored no graph at all: not compared"]
    reports = _node_queries(path, lambda s, run: nway_reports(s, run, ranks="1-7"))[0]
    assert [r.key for r in reports] == ["0/0:aot_forward:0", "1/0:aot_forward:0"]  # 2/0 is on none of 1-7
