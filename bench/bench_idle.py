"""Idle time by cause (issue 42 item 1; NOTE: [Idle time by cause]): graphdeck against HTA's
``get_idle_time_breakdown`` on the same Kineto trace, in this process, CPU seconds
(``time.process_time``; one rank, so HTA parses without worker processes), median and spread of
``--repeat`` runs, and the largest difference of the figures (every stream × cause, µs; graphdeck
with ``hta_scope=True``, the GPU events HTA keeps).

Two figures per trace:

* **from the file**: graphdeck ``ingest_trace`` into a fresh SQLite store (the post-ingest work
  included) then ``idle_breakdown``; HTA ``TraceAnalysis(trace_dir, include_last_profiler_step=True)``
  then ``get_idle_time_breakdown``.
* **the query**: graphdeck ``TraceData`` + ``idle_breakdown`` read from the store (what
  ``GET /api/runs/<run>/idle`` does per rank, GPU and CPU halves); HTA ``get_idle_time_breakdown``
  on its already-parsed frames (its cheapest case).

    python bench/bench_idle.py            # HTA's sampled_rank-0 and negative_queue_length rank0 traces
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
DEFAULT = ["hta/trace_filter/sampled_rank-0.json.gz", "hta/negative_queue_length_values_check/rank0.json.gz"]


def cpu(fn):
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def ours_from_file(path: Path):
    from sqlalchemy.orm import Session

    from graphdeck.analysis.traces.idle import TraceEvents, idle_breakdown
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    with tempfile.TemporaryDirectory() as tmp:
        engine = open_engine(Path(tmp) / "s.db")
        res = ingest_trace(engine, path, run_name="bench")
        with Session(engine) as s:
            doc = idle_breakdown(TraceEvents.load(s, res.trace_id))
        engine.dispose()
    return doc


def ours_query(engine, trace_id: int):
    from sqlalchemy.orm import Session

    from graphdeck.analysis.traces.idle import TraceEvents, idle_breakdown

    with Session(engine) as s:
        return idle_breakdown(TraceEvents.load(s, trace_id))


def hta_load(folder: str):
    from hta.trace_analysis import TraceAnalysis

    return TraceAnalysis(trace_dir=folder, include_last_profiler_step=True)


def hta_breakdown(ta):
    df, _ = ta.get_idle_time_breakdown(ranks=ta.t.get_ranks(), visualize=False)
    return df


def max_diff_us(engine, trace_id: int, df) -> float:
    """The largest |graphdeck − HTA| over streams × causes (µs), graphdeck in HTA's scope."""
    from sqlalchemy.orm import Session

    from graphdeck.analysis.traces.idle import TraceEvents, gpu_idle

    causes = ("host_wait", "kernel_wait", "other")
    with Session(engine) as s:
        g = gpu_idle(TraceEvents.load(s, trace_id), hta_scope=True)
    ours = {(st["stream"], c): st[f"{c}_ns"] / 1000 for st in g["streams"] for c in causes}
    theirs: dict = {}
    for r in df.itertuples():
        key = (str(r.stream), r.idle_category)
        theirs[key] = theirs.get(key, 0.0) + (0.0 if r.idle_time != r.idle_time else r.idle_time)
    return max(abs(ours.get(k, 0.0) - theirs.get(k, 0.0)) for k in set(ours) | set(theirs))


def spread(xs) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="*", help=f"Kineto traces (default: {', '.join(DEFAULT)} under {TRACES})")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # HTA logs every parse at WARNING
    import hta.trace_analysis  # noqa: F401  (imports are not the work)
    import pandas  # noqa: F401

    import graphdeck.analysis.traces.idle  # noqa: F401
    from graphdeck.store.db import open_engine
    from graphdeck.store.traces import ingest_trace

    print(f"load average {os.getloadavg()[0]:.1f} / {os.getloadavg()[2]:.1f} (1 / 15 min)")
    for name in args.traces or [str(TRACES / t) for t in DEFAULT]:
        path = Path(name)
        folder = tempfile.mkdtemp()
        os.symlink(path.resolve(), Path(folder) / path.name)
        ours_file, hta_file, ours_q, hta_q = [], [], [], []
        for _ in range(args.repeat):
            t, doc = cpu(lambda: ours_from_file(path))
            ours_file.append(t)
            t, ta = cpu(lambda: hta_load(folder))
            t2, df = cpu(lambda: hta_breakdown(ta))
            hta_file.append(t + t2)
            hta_q.append(t2)
        with tempfile.TemporaryDirectory() as tmp:
            engine = open_engine(Path(tmp) / "s.db")
            tid = ingest_trace(engine, path, run_name="bench").trace_id
            for _ in range(args.repeat):
                t, doc = cpu(lambda: ours_query(engine, tid))
                ours_q.append(t)
            diff = max_diff_us(engine, tid, df)
            engine.dispose()
        print(f"{path.name} ({path.stat().st_size / 1e6:.2f} MB): largest difference from HTA over streams × causes "
              f"{diff:.0f} µs (graphdeck in HTA's scope: gpu_idle(hta_scope=True))")
        print(f"  from the file: graphdeck {spread(ours_file)} CPU s, HTA {spread(hta_file)} CPU s, "
              f"ratio HTA/graphdeck {statistics.median(hta_file) / statistics.median(ours_file):.2f}")
        print(f"  the query:     graphdeck {spread(ours_q)} CPU s, HTA {spread(hta_q)} CPU s, "
              f"ratio HTA/graphdeck {statistics.median(hta_q) / statistics.median(ours_q):.2f}")


if __name__ == "__main__":
    main()
