"""Flight Recorder dumps at scale: 1,024 ranks × 2,000 entries, one divergent rank (issue 19).

1. A real 2-rank gloo job (torchrun, CPU, ``TORCH_FR_BUFFER_SIZE=2000``) runs 800 steps of: a
   compiled step whose graph all-reduces its activations (group ``mlp``), then an eager
   all-reduce of an 8×8 tensor and a broadcast of 4 floats on the default group: 2,400
   collectives per rank, so each rank's dump is a full, wrapped 2,000-entry ring buffer with
   real stacks (eager and compiled). Dumped with ``_dump_fr_trace()``.
2. Generated from those: 1,024 per-rank pickles, protocol 2 like torch's own (rank r gets the
   real dump of rank r % 2, its ``pg_config`` naming the 1,024 ranks for each group so
   ``fr_trace`` can read it); rank
   :data:`DIVERGENT` skips one all-reduce of the default group near the end (its later sequence
   ids shift down by one, so at that id it holds a broadcast).
3. Timed, :data:`REPEATS` times: ``import_flight_dumps`` into a fresh SQLite store (parsing in
   worker processes) and ``rank_report`` (what ``graphdeck check-ranks`` runs: FR first mismatch
   per group + the join + missing evidence, and its per-rank compile/schedule comparison) — wall
   and CPU seconds (this process and its workers), median and spread, the load average before
   and after each run; ``flight_report`` (the FR part) is timed once more alone; the first
   mismatch found is checked.
4. ``python -m torch.distributed.flight_recorder.fr_trace`` on the same folder, once, with a
   time limit: wall and CPU seconds, and whether it names the same first mismatch.

    python bench/bench_flight.py [--ranks 1024] [--repeats 3] [--fr-trace-limit 900]
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO.parent))
DIVERGENT = 517  # at --ranks 1024; ranks // 2 + 5 otherwise
REPEATS = 3

JOB = textwrap.dedent('''
    import datetime, os, sys, torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    mlp = dist.new_group([0, 1], group_desc="mlp")
    w = torch.ones(8, 8)
    @torch.compile(backend="aot_eager")
    def step(x):
        return funcol.all_reduce(torch.relu(x @ w), "sum", mlp).sum()
    g, b = torch.ones(8, 8), torch.ones(4)
    for i in range(800):
        step(torch.ones(4, 8))
        dist.all_reduce(g)
        dist.broadcast(b, 0)
    with open(os.path.join(sys.argv[1], f"real_{dist.get_rank()}"), "wb") as fh:
        fh.write(torch._C._distributed_c10d._dump_fr_trace())
    dist.destroy_process_group()
''')


def real_dumps(folder: Path) -> list[dict]:
    job = folder / "job.py"
    job.write_text(JOB)
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(job),
                    str(folder)], check=True, env=env, capture_output=True, timeout=600)
    out = []
    for r in (0, 1):
        with open(folder / f"real_{r}", "rb") as fh:
            out.append(pickle.load(fh))
    return out


def divergent(ranks: int) -> int:
    return ranks // 2 + 5


def generate(real: list[dict], folder: Path, ranks: int) -> tuple[str, int]:
    """Write ``ranks`` dumps; returns (group name, sequence id) of the divergent rank's skip."""
    folder.mkdir()
    members = str(list(range(ranks)))
    groups = {tuple(e["process_group"]) for e in real[0]["entries"]}
    default = next(name for name, desc in groups if desc == "default_pg")
    ops = [e for e in real[0]["entries"] if e["process_group"][0] == default]
    skip = next(e["collective_seq_id"] for e in ops[-60:] if e["profiling_name"].endswith("all_reduce"))
    for r in range(ranks):
        d = dict(real[r % 2])
        d["pg_config"] = {n: {"name": n, "desc": desc, "ranks": members} for n, desc in groups}
        if r == divergent(ranks):
            ents = []
            for e in d["entries"]:
                if e["process_group"][0] == default and e["collective_seq_id"] >= skip:
                    if e["collective_seq_id"] == skip:
                        continue
                    e = dict(e, collective_seq_id=e["collective_seq_id"] - 1)
                ents.append(e)
            d["entries"] = ents
        with open(folder / f"fr_{r}", "wb") as fh:
            pickle.dump(d, fh, protocol=2)  # what torch writes: protocol 2, no frames
    return default, skip


def cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def ours(folder: Path, tmp: Path, i: int):
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from graphdeck.analysis.ranks.core import rank_report
    from graphdeck.analysis.ranks.flight import flight_report
    from graphdeck.store.db import open_engine
    from graphdeck.store.fr_import import import_flight_dumps
    from graphdeck.store.schema import Run

    engine = open_engine(tmp / f"bench{i}.db")
    t0, c0 = time.perf_counter(), cpu_s()
    res = import_flight_dumps(engine, folder, run_name="bench")
    t1, c1 = time.perf_counter(), cpu_s()
    with Session(engine) as s:
        rep = rank_report(s, s.scalar(select(Run).where(Run.name == "bench")))
    t2, c2 = time.perf_counter(), cpu_s()
    with Session(engine) as s:  # the Flight Recorder part of check-ranks alone (timed once more)
        fr = flight_report(s, s.scalar(select(Run.id).where(Run.name == "bench")))
    t3 = time.perf_counter()
    engine.dispose()
    assert fr.mismatches[0].headline() == rep.flight.mismatches[0].headline()
    return res, rep, (t1 - t0, c1 - c0, t2 - t1, c2 - c1, t3 - t2)


def fr_trace(folder: Path, tmp: Path, limit: int) -> tuple[float, float, str, str]:
    c0, t0 = cpu_s(), time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder),
                            "-p", "fr_", "-o", str(tmp / "fr.pkl")], capture_output=True, text=True, timeout=limit)
        status, text = f"exit {p.returncode}", p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        status, text = f"killed at the {limit} s limit", (exc.stdout or b"").decode(errors="replace")
    return time.perf_counter() - t0, cpu_s() - c0, status, text


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--fr-trace-limit", type=int, default=900)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        real = real_dumps(tmp)
        folder = tmp / "dumps"
        group, seq = generate(real, folder, args.ranks)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{args.ranks} dumps, {sum(len(d['entries']) for d in real) // 2} entries/rank, {size / 2**20:.0f} MiB; "
              f"rank {divergent(args.ranks)} skips group {group} #{seq}")
        runs = []
        for i in range(args.repeats):
            load0 = os.getloadavg()[0]
            res, rep, times = ours(folder, tmp, i)
            runs.append(times)
            m = rep.flight.mismatches[0]
            print(f"run {i}: import {times[0]:.2f} s wall / {times[1]:.2f} s CPU, check-ranks {times[2]:.2f} s wall / "
                  f"{times[3]:.2f} s CPU (of which the FR analysis alone: {times[4]:.2f} s wall); "
                  f"{res.entries} entries; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; "
                  f"first mismatch: {m.headline()}")
            assert (m.group, m.seq, m.not_reached) == (group, seq, [divergent(args.ranks)]), m.headline()
        wall = [t[0] + t[2] for t in runs]
        cpu = [t[1] + t[3] for t in runs]
        fw, fc, status, text = fr_trace(folder, tmp, args.fr_trace_limit)
        hit = re.search(r"sequence number: (\d+)[^\n]*\n(?:[^\n]*\n){0,2}group info: (\w+)", text)
        same = bool(hit) and (int(hit.group(1)), hit.group(2)) == (seq, group)
        print(f"ours, import + check-ranks: wall {spread(wall)} s, CPU {spread(cpu)} s (median (min–max) of "
              f"{args.repeats}); fr_trace: {fw:.1f} s wall, {fc:.1f} s CPU, {status}; "
              f"fr_trace names the same first mismatch: {same}"
              + (f" (it says sequence {hit.group(1)}, group {hit.group(2)})" if hit else ""))
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
              f"Python {platform.python_version()}")


if __name__ == "__main__":
    main()
