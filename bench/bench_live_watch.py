"""Time from a stall to the written live hang report (issue 38 benchmark, second half), at 2 and
64 ranks on CPU (NOTE: [Live watch] in capture/heartbeat.py).

Each measurement runs tests/live_hang_job.py under torchrun: 2 real gloo ranks with real agents
(heartbeat every ``--interval`` s, threshold ``--threshold`` s, a 15 s collective timeout); at
step 2 rank 1 sleeps, rank 0 waits in the gradient all-reduce. Rank 0's watcher thread sees the
stall, both agents dump their recorder and stacks, and rank 0 gathers every live rank's stacks and
writes the report — the agents' own code, unchanged. At 64 ranks the 62 other ranks are simulated
in the same store by this process: each beats every interval as an agent does (updates its
heartbeat row, then reads every rank's heartbeat) at step 2, and answers a stall at its next beat
with its Python stacks (``python_stacks``, one transaction per rank) — so rank 0 waits for 64
ranks' stacks and the report reads 64 heartbeats and stacks. The simulated ranks write no Flight
Recorder dump (the report names them as ranks without one).

Measured on the job's own clock: ``issued`` (rank 0 starts step 2: its all-reduce follows within
milliseconds), ``detected_at`` (rank 0's watcher saw the stall) and ``written_at`` (the report
stored). Reported: stall → report, and that minus the threshold (the issue's goal: ≤ 10 s after
the threshold), split into detection (stall → detected, minus the threshold) and gathering +
writing (detected → written).

    OMP_NUM_THREADS=1 python bench/bench_live_watch.py [--ranks 2 64] [--repeat 3] [--interval 1] [--threshold 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
JOB = os.path.join(ROOT, "tests", "live_hang_job.py")


def simulate(store: str, ranks: range, interval: float, threshold: float, stop: threading.Event,
             answered: dict) -> None:
    """Beat for ``ranks`` in run ``live`` of ``store`` until ``stop``; answer a stall once."""
    from sqlalchemy import insert, select, update

    from graphdeck.capture.heartbeat import HEARTBEAT, STACKS, python_stacks
    from graphdeck.store.db import open_engine, retrying
    from graphdeck.store.schema import CompileEvent, Run

    table = CompileEvent.__table__
    engine, run_id = None, None
    while run_id is None and not stop.is_set():
        try:
            engine = engine or open_engine(store, create=False)
            with engine.connect() as c:
                run_id = c.execute(select(Run.id).where(Run.name == "live")).scalar()
        except Exception:  # noqa: BLE001 - the store being created by the job
            engine = None
        time.sleep(0.2)
    rows: dict[int, int] = {}
    since = time.time()
    while not stop.wait(interval):
        stalled = False
        for r in ranks:
            now = time.time()
            payload = json.dumps({"t": now, "step": 2, "groups": {
                "0": {"desc": "default_pg", "enqueued": 1, "completed": 1, "since": since, "in_flight": None},
                "1": {"desc": "grads", "enqueued": 8, "completed": 8, "since": since, "in_flight": None}},
                "stalled": None, "threshold_s": threshold, "timeout_s": 15.0, "interval_s": interval,
                "ended": None, "beats": 0, "pid": os.getpid()}, separators=(",", ":"))

            def beat(r=r, payload=payload):
                with engine.begin() as c:
                    if r in rows:
                        c.execute(update(table).where(table.c.id == rows[r]).values(payload=payload))
                    else:
                        rows[r] = c.execute(insert(table).values(run_id=run_id, rank=r, name=HEARTBEAT, compile_id=None,
                                                                 metadata_json="{}", payload=payload)
                                            ).inserted_primary_key[0]
                    return c.execute(select(table.c.payload).where(table.c.run_id == run_id,
                                                                   table.c.name == HEARTBEAT)).scalars().all()

            beats = retrying(beat)
            stalled = stalled or any('"stalled":{' in (p or "") for p in beats)
        if stalled and not answered:
            answered["at"] = time.time()
            for r in ranks:  # each simulated agent's answer, its own transaction
                text = json.dumps(python_stacks(), separators=(",", ":"))

                def write(r=r, text=text):
                    with engine.begin() as c:
                        c.execute(insert(table).values(run_id=run_id, rank=r, name=STACKS, compile_id=None,
                                                       metadata_json=json.dumps({"reason": "stall", "step": 2}),
                                                       payload=text))

                retrying(write)
            answered["done"] = time.time()


def one(world: int, interval: float, threshold: float) -> dict:
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks.live import stored_report
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    tmp = tempfile.mkdtemp(prefix="bench-live-")
    store, out = os.path.join(tmp, "s.db"), os.path.join(tmp, "out")
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAPHDECK_HEARTBEAT_S=str(interval),
               GRAPHDECK_WATCH_THRESHOLD_S=str(threshold))
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    stop, answered = threading.Event(), {}
    sim = threading.Thread(target=simulate, args=(store, range(2, world), interval, threshold, stop, answered),
                           daemon=True) if world > 2 else None
    if sim:
        sim.start()
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", JOB,
                          store, out], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    stop.set()
    if sim:
        sim.join(timeout=30)
    with open(os.path.join(out, "rank0.json")) as fh:
        r0 = json.load(fh)
    with Session(open_engine(store, read_only=True)) as s:
        from sqlalchemy import select

        rep = stored_report(s, s.scalar(select(Run.id).where(Run.name == "live")))
    if rep is None:
        raise SystemExit(f"no report at {world} ranks:\n{job.stderr[-3000:]}")
    issued = r0["issued"]["2"]
    return {"ranks": world, "report_ranks": len(rep["ranks"]), "stall_to_report_s": rep["written_at"] - issued,
            "after_threshold_s": rep["written_at"] - issued - threshold,
            "detect_after_threshold_s": rep["detected_at"] - issued - threshold,
            "gather_write_s": rep["written_at"] - rep["detected_at"],
            "before_timeout_s": r0.get("timeout_at", float("nan")) - rep["written_at"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 64])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--threshold", type=float, default=4.0)
    args = ap.parse_args()
    for world in args.ranks:
        got = []
        for i in range(args.repeat):
            m = one(world, args.interval, args.threshold)
            got.append(m)
            print(f"{world} ranks #{i}: stall -> report {m['stall_to_report_s']:.2f} s ({m['after_threshold_s']:.2f} s "
                  f"after the {args.threshold:g} s threshold: detection {m['detect_after_threshold_s']:.2f} s, "
                  f"gather + write {m['gather_write_s']:.2f} s); {m['report_ranks']} ranks in the report; "
                  f"{m['before_timeout_s']:.2f} s before the timeout", flush=True)
        med = statistics.median(x["after_threshold_s"] for x in got)
        print(f"{world} ranks: median {med:.2f} s after the threshold (max {max(x['after_threshold_s'] for x in got):.2f}"
              f" s) over {args.repeat} runs; interval {args.interval:g} s, threshold {args.threshold:g} s", flush=True)


if __name__ == "__main__":
    main()
