"""Cross-rank comparison at scale: 8 ranks × 50 graphs of ≥ 5,000 nodes each.

The graphs are real FX graphs: a deep MLP with a functional ``all_reduce`` every 16 layers,
traced with ``torch.fx`` and recorded by the capture's own ``record_graph`` (which computes the
structural hash, once, as capture does). Every rank stores the same 50 graphs except rank 5,
whose graph 37 has one changed op at node ~4,000 (the comparison must find it, and the
collective schedules still agree). Written through the capture's StoreWriter into one SQLite store.

Printed: time to record+hash one graph (capture-time cost, anchor), time to store all graphs,
and the time of ``rank_report`` (groups, first differing graph/node, collective schedules) —
the figure the issue targets (< 2 s) — with the ratio to the capture-time hashing of one rank.

    python bench/bench_ranks.py [--ranks 8] [--graphs 50] [--layers 1250]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.ranks.core import rank_report
from graphdeck.capture.fxrecord import record_graph
from graphdeck.capture.writer import StoreWriter
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Run


def build_graph(layers: int, changed_at: int | None = None) -> torch.fx.GraphModule:
    """A deep MLP as an FX graph: per layer mm + add + relu (+ an all_reduce every 16 layers)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    h = x
    for i in range(layers):
        h = graph.call_function(torch.ops.aten.mm.default, (h, w))
        h = graph.call_function(torch.ops.aten.add.Tensor, (h, 1.0))
        op = torch.ops.aten.gelu.default if i == changed_at else torch.ops.aten.relu.default
        h = graph.call_function(op, (h,))
        if i % 16 == 15:
            h = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (h, "sum", "0"))
            h = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (h,))
    graph.output(h)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    # Shapes as FakeTensor-propagated metadata would give them.
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["val"] = torch.empty(64, 64)
    return gm


def _replicate(store: Path, ranks: int, graphs: int, *, changed_rank: int, changed_graph: int) -> None:
    """Copy rank 0's graphs (rows of graphs/nodes/edges) to every other rank, keeping graph order;
    ``changed_rank`` keeps its own already-written graph ``changed_graph``."""
    db = sqlite3.connect(store)
    cols_g = [c[1] for c in db.execute("PRAGMA table_info(graphs)") if c[1] != "id"]
    cols_n = [c[1] for c in db.execute("PRAGMA table_info(nodes)") if c[1] not in ("id", "graph_id")]
    cols_e = [c[1] for c in db.execute("PRAGMA table_info(edges)") if c[1] not in ("id", "graph_id")]
    run_id = db.execute("SELECT id FROM runs WHERE name='bench'").fetchone()[0]
    src = [r[0] for r in db.execute("SELECT id FROM graphs WHERE run_id=? AND rank=0 ORDER BY ordinal", (run_id,))]
    own = db.execute("SELECT id FROM graphs WHERE run_id=? AND rank=?", (run_id, changed_rank)).fetchone()[0]
    for rank in range(1, ranks):
        for g, gid in enumerate(src):
            if rank == changed_rank and g == changed_graph:
                db.execute("UPDATE graphs SET ordinal=? WHERE id=?", (g, own))
                continue
            sel = ", ".join("? " if c == "rank" else ("? " if c == "ordinal" else c) for c in cols_g)
            db.execute(f"INSERT INTO graphs ({', '.join(cols_g)}) SELECT {sel} FROM graphs WHERE id=?",
                       [rank if c == "rank" else g for c in cols_g if c in ("rank", "ordinal")] + [gid])
            new = db.execute("SELECT last_insert_rowid()").fetchone()[0]
            db.execute(f"INSERT INTO nodes (graph_id, {', '.join(cols_n)}) SELECT ?, {', '.join(cols_n)} "
                       "FROM nodes WHERE graph_id=?", (new, gid))
            db.execute(f"INSERT INTO edges (graph_id, {', '.join(cols_e)}) SELECT ?, {', '.join(cols_e)} "
                       "FROM edges WHERE graph_id=?", (new, gid))
    db.commit()
    db.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--graphs", type=int, default=50)
    ap.add_argument("--layers", type=int, default=1600, help="3 nodes per layer (+2 per 16 layers)")
    ap.add_argument("--keep", type=Path, default=None, help="write the store here and keep it (reused if present)")
    args = ap.parse_args()
    _ = funcol  # registers torch.ops._c10d_functional

    odd = min(37, args.graphs - 1)  # rank 5's changed graph
    t0 = time.perf_counter()
    base = record_graph(build_graph(args.layers))
    hash_one_s = time.perf_counter() - t0
    changed = record_graph(build_graph(args.layers, changed_at=args.layers * 4 // 5))
    print(f"graph: {len(base.nodes)} nodes, {len(base.edges)} edges; record+hash one graph {hash_one_s:.3f} s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        store = args.keep or Path(tmp) / "ranks.db"
        t0 = time.perf_counter()
        reuse = store.exists()
        # Rank 0 (and rank 5's changed graph) through the capture's writer; the other ranks'
        # identical rows copied in SQL, which is what a real capture would have written.
        for rank in range(0 if reuse else args.ranks):
            writer = StoreWriter(store, "bench", rank, args.ranks, backend="gloo")
            if rank == 0:
                for g in range(args.graphs):
                    writer.write_graph(base, kind="aot_forward", name=f"graph {g}", compile_id=f"{g}/0")
            elif rank == 5:
                writer.write_graph(changed, kind="aot_forward", name=f"graph {odd}", compile_id=f"{odd}/0")
        if not reuse:
            _replicate(store, args.ranks, args.graphs, changed_rank=5, changed_graph=odd)
        print(f"stored {args.ranks * args.graphs} graphs ({args.ranks * args.graphs * len(base.nodes):,} nodes)"
              f" in {time.perf_counter() - t0:.1f} s", flush=True)

        engine = open_engine(store, read_only=True)
        timings = []
        for _ in range(3):
            with Session(engine) as s:
                t0 = time.perf_counter()
                report = rank_report(s, s.scalar(select(Run).where(Run.name == "bench")))
                timings.append(time.perf_counter() - t0)
        (d,) = report.divergences
        assert report.groups == [[r for r in range(args.ranks) if r != 5], [5]], report.groups
        assert d.node is not None and d.node.target == "aten.gelu.default", d
        assert not report.collective_mismatches
        n_coll = len(report.schedules[0])
        best = min(timings)
        print(f"rank_report: {best:.3f} s best of 3 (runs {', '.join(f'{t:.3f}' for t in timings)}); "
              f"groups {report.groups}; first differing node {d.node.name} ({d.node.target}) in graph {d.position};"
              f" {n_coll} collectives per rank")
        print(f"ratio: comparing {args.ranks} ranks takes {best / (hash_one_s * args.graphs):.2f}x the capture-time "
              f"hashing of one rank's {args.graphs} graphs; target < 2 s: {'met' if best < 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
