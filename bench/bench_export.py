"""``graphdeck export-trace`` at N ranks: CPU time, peak memory and events/s (issue 26 item 3).

Input: the 2 x H200 DDP store of tests/data/ddp_h200x2 (GPT-2 under Inductor, ~25k events a rank,
70 NCCL all-reduces, kernel → node links rebuilt as tests/test_h200x2.py does), grown to N ranks
inside SQLite: rank r is a copy of rank r % 2's trace (events, meta) shifted by ``r`` µs plus a
seeded jitter of up to 50 µs, and of that rank's ``kernel_nodes`` rows, so every rank maps its
kernels to the same graphs, then each trace's collective index and kernel → node links as its
ingest keeps them (NOTE: [Stored kernel links]; ``--no-links``: without them). This is not item
1's scale harness (no straggler, no divergence); it measures the export alone. Each export runs as a child process under GNU ``/usr/bin/time``
(CPU = user + system, interpreter start included; peak RSS), writing ``.json.gz``.

Usage::

    python bench/bench_export.py --ranks 2 16 64 [--repeat 3] [--copies 2] [--no-links]
"""

from __future__ import annotations

import argparse
import gzip
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # graphdeck from this checkout when run as a script
DATA = ROOT / "tests" / "data" / "ddp_h200x2"


def make_store(path: Path, n: int, seed: int = 0, copies: int = 1, links: bool = True) -> int:
    """The DDP store grown to ``n`` ranks (see the module docstring); returns its event count.
    ``copies`` > 1: each rank's events repeated that many times, copy j shifted by j times the
    longest trace's span plus 1 ms (the same shift on every rank, so collectives still match).
    ``links``: keep each trace's kernel → node links as its ingest does (``False``: a store written
    by a graphdeck before schema 6, which export maps from the events)."""
    from sqlalchemy import text

    from graphdeck.analysis.traces.mapping import link_kernels
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    with gzip.open(DATA / "ddp.db.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    engine = open_engine(path)
    for rank in (0, 1):
        ingest_trace(engine, DATA / f"ddp_rank{rank}.pt.trace.json.gz", run_name="ddp", strict=True)
    link_kernels(engine, 1)
    rng = random.Random(seed)
    with engine.begin() as c:
        base = dict(c.execute(text("SELECT rank, id FROM traces WHERE run_id = 1")).all())
        for r in range(2, n):
            shift = r * 1000 + rng.randrange(50_000)
            tid = c.execute(text(
                "INSERT INTO traces (run_id, rank, name, status, num_events, start_ns, end_ns, created_at, stats_json, "
                "meta_json) SELECT run_id, :r, name || ' copy', status, num_events, start_ns + :s, end_ns + :s, "
                "created_at, stats_json, meta_json FROM traces WHERE id = :t RETURNING id"),
                {"r": r, "s": shift, "t": base[r % 2]}).scalar()
            c.execute(text("INSERT INTO trace_events (trace_id, ph, name_id, cat_id, ts_ns, dur_ns, pid, tid, "
                           "correlation, args_json) SELECT :n, ph, name_id, cat_id, ts_ns + :s, dur_ns, pid, tid, "
                           "correlation, args_json FROM trace_events WHERE trace_id = :t"),
                      {"n": tid, "s": shift, "t": base[r % 2]})
            c.execute(text("INSERT INTO kernel_nodes (run_id, rank, compile_id, graph_id, kernel_name, node_name, "
                           "pre_grad_node, source, call_index) SELECT run_id, :r, compile_id, graph_id, kernel_name, "
                           "node_name, pre_grad_node, source, call_index FROM kernel_nodes WHERE run_id = 1 AND rank = :o"),
                      {"r": r, "o": r % 2})
        if copies > 1:
            span = c.execute(text("SELECT MAX(end_ns - start_ns) FROM traces")).scalar() + 1_000_000
            for j in range(1, copies):
                c.execute(text("INSERT INTO trace_events (trace_id, ph, name_id, cat_id, ts_ns, dur_ns, pid, tid, "
                               "correlation, args_json) SELECT trace_id, ph, name_id, cat_id, ts_ns + :s, dur_ns, pid, "
                               "tid, correlation + :k, args_json FROM trace_events WHERE ts_ns < "
                               "(SELECT start_ns FROM traces WHERE id = trace_id) + :span"),
                          {"s": j * span, "k": j * 10_000_000, "span": span})
            c.execute(text("UPDATE traces SET end_ns = end_ns + :s, num_events = (SELECT COUNT(*) FROM trace_events "
                           "WHERE trace_id = traces.id)"), {"s": (copies - 1) * span})
        events = c.execute(text("SELECT COUNT(*) FROM trace_events")).scalar()
    from sqlalchemy.orm import Session

    from graphdeck.analysis.traces.collectives import store_index

    with Session(engine) as s:  # each copy's collective index, as its ingest would have kept it
        traces = s.execute(text("SELECT id FROM traces ORDER BY id")).scalars().all()
        for tid in traces:
            store_index(s, tid)
        s.commit()
    if links:  # and its kernel → node links (NOTE: [Stored kernel links]), as an ingest after link_kernels keeps them
        from graphdeck.analysis.traces.export_map import record_links

        kept = sum(record_links(engine, tid) for tid in traces)
        print(f"kernel links kept at ingest for {kept} of {len(traces)} traces")
    engine.dispose()
    return events


def timed_export(store: Path, ranks: str, out: Path) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MiB) of one ``graphdeck export-trace`` child."""
    proc = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", sys.executable, "-m", "graphdeck.cli",
                           "export-trace", str(store), "--run", "ddp", "--ranks", ranks, "-o", str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    wall, user, system, rss = proc.stderr.strip().splitlines()[-1].split()
    return float(wall), float(user) + float(system), int(rss) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 16, 64], help="rank counts to export")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--copies", type=int, default=1, help="each rank's events repeated (2: ~50k events a rank)")
    ap.add_argument("--no-links", action="store_true",
                    help="no kernel links kept at ingest (an older store: export maps each rank's events)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gd-bench-export-"))
    try:
        store = tmp / "ddp.db"
        events = make_store(store, max(args.ranks), copies=args.copies, links=not args.no_links)
        print(f"store: {max(args.ranks)} ranks, {events:,} events")
        print(f"{'ranks':>5s} {'events':>10s} {'CPU s med':>9s} {'min-max':>11s} {'wall s':>7s} {'peak MiB':>8s} "
              f"{'events/CPU s':>12s} {'MB gz':>6s}")
        for n in args.ranks:
            out = tmp / f"r{n}.json.gz"
            runs = [timed_export(store, f"0-{n - 1}", out) for _ in range(args.repeat)]
            cpu = [r[1] for r in runs]
            n_events = events * n // max(args.ranks)
            print(f"{n:5d} {n_events:10,d} {statistics.median(cpu):9.2f} {min(cpu):5.2f}-{max(cpu):5.2f} "
                  f"{statistics.median(r[0] for r in runs):7.2f} {statistics.median(r[2] for r in runs):8.0f} "
                  f"{n_events / statistics.median(cpu):12,.0f} {out.stat().st_size / 1e6:6.1f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
