"""Graph-derived liveness at scale: a stored FX graph of ≥ 100,000 nodes.

The graph is a real FX graph (a deep MLP: mm, add, relu, and a view every layer, so aliases are
exercised) recorded by the capture's ``record_graph`` and stored by its ``StoreWriter``. Printed:
the floor — fetching the graph's node rows (the 8 columns liveness reads) and edge rows through
the DB-API, nothing else — and ``graph_memory`` (read + storages + live curve + peak holders), wall
and CPU, best and median of ``--repeat`` runs, with their ratio; and the load average (the host is
shared: wall time under load is not CPU time). Target: < 1 s.

    python bench/bench_memory.py [--layers 25000] [--repeat 5] [--keep STORE] [--against REV]

``--against REV`` also times ``graph_memory`` as ``analysis/memory/core.py`` was at git revision REV,
interleaved with the current one (same load for both), and checks both give the same curve.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.fx
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.memory.core import graph_memory
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


def load_revision(rev: str, tmp: Path):
    """``analysis/memory/core.py`` as of git revision ``rev``, imported as a separate module."""
    repo = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:analysis/memory/core.py"], cwd=repo, capture_output=True, text=True,
                         check=True).stdout
    path = tmp / "memory_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("memory_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_at_rev"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=25000)
    ap.add_argument("--keep", type=Path, default=None, help="store path to write and reuse")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--against", default=None, help="git revision whose analysis/memory/core.py is timed too")
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
        floor, ours, theirs = [], [], []
        ref = load_revision(args.against, Path(tmp)) if args.against else None
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
            if ref is not None:
                with Session(engine) as s:
                    t0, c0 = time.perf_counter(), time.process_time()
                    ref_curve = ref.graph_memory(s, gid)
                    theirs.append((time.perf_counter() - t0, time.process_time() - c0))
                assert (ref_curve.live_bytes, ref_curve.peak_index) == (curve.live_bytes, curve.peak_index)
        print(f"graph: {len(curve.nodes):,} nodes; peak {curve.peak_bytes:,} bytes at "
              f"{curve.peak_node}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

        def stats(xs):
            wall, cpu = [x[0] for x in xs], [x[1] for x in xs]
            return (f"wall best {min(wall):.3f} s, median {statistics.median(wall):.3f} s; "
                    f"CPU best {min(cpu):.3f} s, median {statistics.median(cpu):.3f} s")
        print(f"fetch rows (floor):  {stats(floor)}")
        print(f"graph_memory:        {stats(ours)}")
        if theirs:
            print(f"graph_memory @ {args.against}: {stats(theirs)} (same curve and peak); "
                  f"now {statistics.median(x[0] for x in theirs) / statistics.median(x[0] for x in ours):.2f}x "
                  "faster (median wall)")
        best = min(x[0] for x in ours)
        print(f"ratio to the floor (best wall): {best / min(x[0] for x in floor):.2f}x; "
              f"target < 1 s: {'met' if best < 1 else 'NOT met'} ({args.repeat} runs)")

if __name__ == "__main__":
    main()
