"""Benchmark: Python memory (tracemalloc peak) of the ingest's post-ingest work on a rank WITH
Inductor kernel tables, as the trace grows (issue 36 item 9): the 2 x H200 DDP store's rank 0
trace once and ``--copies`` times end to end (each copy's times and launch ids shifted, as
tests/test_ingest_memory.py's ``ddp_copies``), ingested, then ``record_links(full=True)`` (the
kept links and the by_kernel it hands on) and the node-time hook (``node_times.record``) measured
apart.

    python bench/bench_kernel_table_memory.py --copies 1,4
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    from test_ingest_memory import DDP, ddp_copies

    from graphdeck.analysis.traces.export_map import record_links
    from graphdeck.analysis.traces.mapping import link_kernels
    from graphdeck.store import node_times
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", default="1,4", help="comma-separated copy counts")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    store = tmp / "ddp.db"
    with gzip.open(DDP / "ddp.db.gz") as src, open(store, "wb") as dst:
        shutil.copyfileobj(src, dst)
    engine = open_engine(store)
    link_kernels(engine, 1)
    for copies in (int(c) for c in args.copies.split(",")):
        path = ddp_copies(DDP / "ddp_rank0.pt.trace.json.gz", tmp / f"x{copies}.json", copies)
        trace_id = ingest_trace(engine, path, run_name="ddp", strict=True).trace_id
        tracemalloc.start()
        by_kernel = record_links(engine, trace_id, full=True)
        links_peak, kept = tracemalloc.get_traced_memory()[1], tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        node_times.record(engine, trace_id, by_kernel)
        hook_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{copies} cop{'y' if copies == 1 else 'ies'}: record_links peak {links_peak / 2**20:.1f} MiB "
              f"(by_kernel kept {kept / 2**20:.1f}); node-time hook peak {hook_peak / 2**20:.1f} MiB")
    engine.dispose()
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
