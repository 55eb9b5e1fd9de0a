"""Graph-derived liveness at scale: a stored FX graph of ≥ 100,000 nodes.

The graph is a real FX graph (a deep MLP: mm, add, relu, and a view every layer, so aliases are
exercised) recorded by the capture's ``record_graph`` and stored by its ``StoreWriter``. Printed:
the floor — fetching the graph's node rows (the 8 columns liveness reads) and edge rows through
the DB-API, nothing else — and ``graph_memory`` (read + storages + live curve + peak holders), wall
and CPU, best and median of ``--repeat`` runs, with their ratio; and the load average (the host is
shared: wall time under load is not CPU time). Target: < 1 s.

    python bench/bench_memory.py [--layers 25000] [--repeat 5] [--keep STORE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.fx
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory import graph_memory
from graphdeck.capture.fxrecord import record_graph
from graphdeck.capture.writer import StoreWriter
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Graph


def build(layers: int) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    h = x
    for _ in range(layers):
        h = g.call_function(torch.ops.aten.mm.default, (h, w))
        h = g.call_function(torch.ops.aten.view.default, (h, [64, 64]))
        h = g.call_function(torch.ops.aten.add.Tensor, (h, 1.0))
        h = g.call_function(torch.ops.aten.relu.default, (h,))
    g.output(h)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    for n in gm.graph.nodes:
        if n.op != "output":
            n.meta["val"] = torch.empty(64, 64)
    return gm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=25000)
    ap.add_argument("--keep", type=Path, default=None, help="store path to write and reuse")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = args.keep or Path(tmp) / "mem.db"
        if store.exists():
            with Session(open_engine(store, read_only=True)) as s:
                gid = s.scalar(select(Graph.id).where(Graph.name == "deep"))
        else:
            rec = record_graph(build(args.layers))
            gid = StoreWriter(store, "bench", 0, 1).write_graph(rec, kind="aot_forward", name="deep",
                                                                compile_id="0/0")
        engine = open_engine(store, read_only=True)
        floor, ours = [], []
        for _ in range(args.repeat):
            with Session(engine) as s:
                raw = s.connection().connection.driver_connection
                t0, c0 = time.perf_counter(), time.process_time()
                raw.execute("SELECT idx, name, op, target_id, size_bytes, dtype, module_path_id, seq_nr FROM nodes "
                            "WHERE graph_id = ? ORDER BY idx", (gid,)).fetchall()
                raw.execute("SELECT src_idx, dst_idx FROM edges WHERE graph_id = ? ORDER BY id", (gid,)).fetchall()
                floor.append((time.perf_counter() - t0, time.process_time() - c0))
            with Session(engine) as s:
                t0, c0 = time.perf_counter(), time.process_time()
                curve = graph_memory(s, gid)
                ours.append((time.perf_counter() - t0, time.process_time() - c0))
        print(f"graph: {len(curve.nodes):,} nodes; peak {curve.peak_bytes:,} bytes at "
              f"{curve.peak_node}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

        def stats(xs):
            wall, cpu = [x[0] for x in xs], [x[1] for x in xs]
            return (f"wall best {min(wall):.3f} s, median {statistics.median(wall):.3f} s; "
                    f"CPU best {min(cpu):.3f} s, median {statistics.median(cpu):.3f} s")
        print(f"fetch rows (floor):  {stats(floor)}")
        print(f"graph_memory:        {stats(ours)}")
        best = min(x[0] for x in ours)
        print(f"ratio to the floor (best wall): {best / min(x[0] for x in floor):.2f}x; "
              f"target < 1 s: {'met' if best < 1 else 'NOT met'} ({args.repeat} runs)")

if __name__ == "__main__":
    main()
