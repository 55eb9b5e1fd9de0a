"""Graph-derived liveness at scale: a stored FX graph of ≥ 100,000 nodes.

The graph is a real FX graph (a deep MLP: mm, add, relu, and a view every layer, so aliases are
exercised) recorded by the capture's ``record_graph`` and stored by its ``StoreWriter``. Printed:
the floor — reading the graph's node and edge rows from SQLite (``analysis.memory._load``) — and
``graph_memory`` (read + storages + live curve + peak holders), best of 3, with their ratio.
Target: < 1 s.

    python bench/bench_memory.py [--layers 25000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.fx
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory import _load, graph_memory
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
        for _ in range(3):
            with Session(engine) as s:
                t0 = time.perf_counter()
                _load(s, gid)
                floor.append(time.perf_counter() - t0)
            with Session(engine) as s:
                t0 = time.perf_counter()
                curve = graph_memory(s, gid)
                ours.append(time.perf_counter() - t0)
        print(f"graph: {len(curve.nodes):,} nodes; peak {curve.peak_bytes:,} bytes at "
              f"{curve.peak_node}")
        print(f"read rows (floor): {min(floor):.3f} s; graph_memory: {min(ours):.3f} s (best of 3); "
              f"ratio {min(ours) / min(floor):.2f}x the floor; target < 1 s: {'met' if min(ours) < 1 else 'NOT met'}")


if __name__ == "__main__":
    main()
