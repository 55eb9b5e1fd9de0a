"""Server CPU of the per-rank cost view (issue 42 item 4; NOTE: [Rank cost view]) on an N-rank run
of the scale harness (bench/scale_harness.py).

Serves STORE with the real app (uvicorn in a thread of this process) and asks
``GET /api/runs/RUN/costs`` (after one ``GET /api/runs`` and the modules' import; cold: nothing remembered; warm: the run's
compile seconds remembered), reporting this process's CPU seconds (``time.process_time``:
the server's work, JSON encoding included, plus httpx's small share) per request.

    python bench/scale_harness.py /tmp/s.db --ranks 1024 --events-per-rank 400 --workers 1
    python bench/bench_cost_view.py /tmp/s.db --run scale
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import httpx

    from tests.conftest import LiveServer

    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--run", default="scale")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import graphdeck.analysis.ranks.compile_skew  # noqa: F401  (imports are not the request's work)
    import graphdeck.analysis.ranks.cost  # noqa: F401
    import graphdeck.analysis.traces.collectives  # noqa: F401

    with LiveServer(Path(args.store)) as srv:
        httpx.get(f"{srv.url}/api/runs", timeout=600)  # the app's first request (engine, caches) apart
        for i in range(args.repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            resp = httpx.get(f"{srv.url}/api/runs/{args.run}/costs", params={"sort": "step_time_ns"}, timeout=600)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            doc = resp.json()
            print(f"{'cold' if i == 0 else 'warm'}: {len(doc['rows'])} ranks, step {doc['step']}, "
                  f"{cpu:.3f} s CPU, {wall:.3f} s wall, {len(resp.content) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
