"""N rank processes writing one capture each into one store at the same moment (or one rank killed).

Usage: ``python tests/programs/store_writers.py STORE N_RANKS N_GRAPHS [--trace FILE] [--hold-s S]``.

The parent imports torch and traces a small module once, then forks ``N_RANKS`` real processes
that meet at a barrier and each run the capture agent's writer (``StoreWriter``: rank
registration, parameters, one transaction per graph with its nodes and edges, compile records)
into ``STORE`` (a SQLite path or a PostgreSQL URL) that none of them has created yet. Prints one
JSON line: ``{"exit_codes": [...], "errors": [...], "write_s": wall seconds from the common start
to the last rank's exit, "nodes_per_graph": N, "edges_per_graph": M}``.

``--trace FILE``: each rank then also ingests FILE (a Kineto trace) as its own trace, strictly,
through the real ingest (``graphdeck.store.traces.ingest_trace``), all ranks at once.

``--hold-s S``: one rank only (in the foreground); its third graph transaction prints ``holding``
and sleeps S seconds before it commits (a rank "mid-capture"), so a test can SIGKILL it inside.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import traceback

import torch

from graphdeck.capture.fxrecord import record_graph
from graphdeck.capture.writer import StoreWriter


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        for _ in range(4):
            x = torch.relu(self.norm(self.lin(x))) + x
        return x.sum()


def _record():
    gm = torch.fx.symbolic_trace(Block())
    return record_graph(gm)


def rank_main(store: str, rank: int, world: int, n_graphs: int, barrier, errors, hold_s: float,
              trace: str | None = None) -> None:
    try:
        rec = _record()
        if barrier is not None:
            barrier.wait(timeout=120)
        writer = StoreWriter(store, "writers", rank, world, backend="gloo")
        writer.write_params([{"fqn": f"lin.weight.{i}", "kind": "parameter", "storage_key": f"k{rank}.{i}",
                              "shape": [8, 8], "dtype": "torch.float32", "numel": 64, "size_bytes": 256,
                              "requires_grad": True} for i in range(4)])
        if hold_s:
            _hold_each_graph(writer, hold_s)
        for i in range(n_graphs):
            writer.write_graph(rec, kind="dynamo", name=f"rank{rank}_graph{i}", compile_id=f"{i}/0",
                               meta={"rank": rank, "i": i})
            writer.write_compile_events([{"name": "compilation_metrics", "compile_id": f"{i}/0",
                                          "metadata": {"rank": rank, "i": i}}])
            print(f"rank {rank} wrote graph {i}", flush=True)
        if trace:
            from graphdeck.store.traces import ingest_trace

            # Every rank ingests the same file as its own trace: the same bytes on purpose, so the
            # run's duplicate check (store/trace_dedupe.py) is told to allow them.
            ingest_trace(writer.engine, trace, run_name="writers", rank=rank, name=f"rank{rank}_{os.path.basename(trace)}",
                         strict=True, duplicate="allow")
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the run
        errors.append(f"rank {rank}: {traceback.format_exc()}")
        sys.exit(1)


def _hold_each_graph(writer: StoreWriter, hold_s: float) -> None:
    """Sleep inside the third graph transaction, its rows flushed to the store, before the commit."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    seen = []

    # The writer inserts a graph's nodes by Core executemany (capture/writer.py), so they never show
    # in ``session.new``: the insert into ``nodes`` marks the session's transaction as a graph's.
    @event.listens_for(Session, "do_orm_execute")
    def mark(state):
        if state.is_insert and getattr(state.statement, "table", None) is not None \
                and state.statement.table.name == "nodes":
            state.session.info["graphdeck_nodes"] = True

    @event.listens_for(Session, "before_commit")
    def hold(session):
        if session.info.pop("graphdeck_nodes", False) or any(type(o).__name__ == "Node" for o in session.new):
            seen.append(1)
            if len(seen) == 3:
                session.flush()
                print("holding", flush=True)
                time.sleep(hold_s)


def main() -> None:
    store, n_ranks, n_graphs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hold_s = float(sys.argv[sys.argv.index("--hold-s") + 1]) if "--hold-s" in sys.argv else 0.0
    trace = sys.argv[sys.argv.index("--trace") + 1] if "--trace" in sys.argv else None
    rec = _record()
    if hold_s:
        rank_main(store, 0, 1, n_graphs, None, [], hold_s)
        return
    ctx = mp.get_context("fork")
    manager = ctx.Manager()
    errors = manager.list()
    barrier = ctx.Barrier(n_ranks + 1)  # the parent too: it times from the common start
    procs = [ctx.Process(target=rank_main, args=(store, r, n_ranks, n_graphs, barrier, errors, 0.0, trace))
             for r in range(n_ranks)]
    for p in procs:
        p.start()
    barrier.wait(timeout=300)
    t0 = time.perf_counter()
    for p in procs:
        p.join(timeout=600)
    write_s = time.perf_counter() - t0
    print(json.dumps({"exit_codes": [p.exitcode for p in procs], "errors": list(errors), "write_s": write_s,
                      "nodes_per_graph": len(rec.nodes), "edges_per_graph": len(rec.edges),
                      "pid": os.getpid()}))


if __name__ == "__main__":
    main()
