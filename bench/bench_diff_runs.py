"""``diff-runs`` at scale (issue 21 benchmark, target < 2 s): two 8-rank runs of 51 graphs per rank.

How the two runs are made (setup, not timed):

1. One real capture: the small GPT-2 of ``tests/conftest.py`` (``TINY_SCRIPT``: 1 layer, aot_eager
   through the graphdeck backend, 3 steps, one profiled) into a scratch store; its rank 0 holds a
   Dynamo graph with its AOT forward and backward graphs and the compile records.
2. Runs ``bench_a`` and ``bench_b`` are written into a new store by copying those rows with SQL:
   8 ranks (``ranks`` rows), each with 17 compiles ``k/0`` (k = 0..16) of the 3 graphs = 51
   graphs per rank (``graphs``, ``nodes``, ``edges``, ``graph_io`` rows copied with new ids;
   parents, compile ids, ordinals and names renumbered; structural hashes kept, so the two runs
   join graph for graph) and the compile records of each compile (``compile_events`` with the
   compile id renamed).
3. Each rank gets a Kineto-format trace of 8 profiled steps written as aot_eager writes them: per
   step and compile a ``Torch-Compiled Region: k/0`` range holding a ``CompiledFunction`` whose
   children are the forward graph's aten ops in order, then a ``CompiledFunctionBackward`` (same
   ``Sequence number``) holding the backward graph's; op durations 2–60 µs (fixed per node, ±4 %
   per step). Ingested with :func:`graphdeck.store.traces.ingest_trace` (~27k events per rank).
   In run B one forward ``aten::addmm`` of compile 3 is 40x slower on every rank, so the diff
   has one real regression to find. The ingest maps each trace onto its rank's graphs and keeps
   the node times (NOTE: [Node-time table] in graphdeck/store/node_times.py): its CPU seconds per
   trace, and the table's share of them, are printed (setup, not part of the diff's time).

With ``--reuse`` on a store built before the table existed (or migrated to it), the node times are
mapped from the events as before; the bench prints where they came from.

Timed: ``diff_runs`` (all sections: compile records, graph join, node times of 16 traces, memory,
rank consistency of both runs, gradient paths of both runs) + its text rendering, in process,
``--repeat`` times (CPU seconds by ``time.process_time``, wall by ``time.perf_counter``); and the
CLI ``graphdeck diff-runs STORE bench_a bench_b`` once per repeat as a child (CPU from
``getrusage(RUSAGE_CHILDREN)``, interpreter start and imports included).

    OMP_NUM_THREADS=1 python bench/bench_diff_runs.py [--repeat 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.conftest for TINY_SCRIPT

RANKS, COMPILES, STEPS = 8, 17, 8


def capture_source(scratch: Path) -> Path:
    from tests.conftest import TINY_SCRIPT, run_python

    src = scratch / "source.db"
    run_python(TINY_SCRIPT, str(src), env={"OMP_NUM_THREADS": "1"})
    return src


def build_runs(src_path: Path, dst_path: Path) -> dict:
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import CompileEvent, Edge, Graph, GraphIO, InternedString, Node, Rank, Run

    src = open_engine(src_path, read_only=True)
    dst = open_engine(dst_path)
    with Session(src) as s:
        run = s.scalar(select(Run).where(Run.name == "tiny"))
        graphs = s.scalars(select(Graph).where(Graph.run_id == run.id, Graph.rank == 0).order_by(Graph.ordinal)).all()
        strings = {i: v for i, v in s.execute(select(InternedString.id, InternedString.value))}
        events = s.scalars(select(CompileEvent).where(CompileEvent.run_id == run.id, CompileEvent.rank == 0)).all()
        nodes = {g.id: [dict(r._mapping) for r in s.execute(select(Node.__table__).where(Node.graph_id == g.id)
                                                           .order_by(Node.idx))] for g in graphs}
        edges = {g.id: [dict(r._mapping) for r in s.execute(select(Edge.__table__).where(Edge.graph_id == g.id))]
                 for g in graphs}
        ios = {g.id: [dict(r._mapping) for r in s.execute(select(GraphIO.__table__).where(GraphIO.graph_id == g.id))]
               for g in graphs}
        gcols = [c.name for c in Graph.__table__.columns if c.name != "id"]
        ginfo = [{c: getattr(g, c) for c in gcols} | {"old_id": g.id} for g in graphs]
        ev_rows = [{"name": e.name, "compile_id": e.compile_id, "metadata_json": e.metadata_json, "payload": e.payload}
                   for e in events]
    with dst.begin() as conn:  # strings first: the same values, new ids
        have = dict(conn.execute(select(InternedString.value, InternedString.id)).all())
        missing = [{"value": v} for v in set(strings.values()) if v not in have]
        if missing:
            conn.execute(insert(InternedString), missing)
        have = dict(conn.execute(select(InternedString.value, InternedString.id)).all())
    sid = {old: have[v] for old, v in strings.items()}
    out = {}
    for name in ("bench_a", "bench_b"):
        with dst.begin() as conn:
            run_id = conn.execute(insert(Run).values(name=name, world_size=RANKS, meta_json="{}")).inserted_primary_key[0]
            for r in range(RANKS):
                conn.execute(insert(Rank).values(run_id=run_id, rank=r, world_size=RANKS, backend="gloo", meta_json="{}"))
                ordinal = 0
                for k in range(COMPILES):
                    new_id: dict[int, int] = {}
                    for g in ginfo:
                        row = {c: g[c] for c in gcols}
                        row.update(run_id=run_id, rank=r, ordinal=ordinal, compile_id=f"{k}/0",
                                   parent_id=new_id.get(g["parent_id"]), name=f"{g['name']} k{k}",
                                   frame_name=f"{g['frame_name']} k{k}")
                        ordinal += 1
                        gid = conn.execute(insert(Graph).values(**row)).inserted_primary_key[0]
                        new_id[g["old_id"]] = gid
                        nrows = []
                        for n in nodes[g["old_id"]]:
                            n = dict(n)
                            n.pop("id")
                            n["graph_id"] = gid
                            for col in ("target_id", "module_path_id", "stack_trace_id"):
                                if n[col] is not None:
                                    n[col] = sid[n[col]]
                            nrows.append(n)
                        conn.execute(insert(Node), nrows)
                        for table, rows in ((Edge, edges[g["old_id"]]), (GraphIO, ios[g["old_id"]])):
                            rows = [{**{c: v for c, v in x.items() if c != "id"}, "graph_id": gid} for x in rows]
                            if rows:
                                conn.execute(insert(table), rows)
                    conn.execute(insert(CompileEvent), [
                        {**e, "run_id": run_id, "rank": r,
                         "compile_id": f"{k}/0" if e["compile_id"] == "0/0" else e["compile_id"],
                         "metadata_json": e["metadata_json"].replace('"compile_id": "0/0"', f'"compile_id": "{k}/0"')}
                        for e in ev_rows if e["compile_id"] in ("0/0", None) or k == 0])
        out[name] = run_id
    seqs = {}
    with Session(dst) as s:
        for kind in ("aot_forward", "aot_backward"):
            gid = s.scalar(select(Graph.id).where(Graph.run_id == out["bench_a"], Graph.rank == 0, Graph.kind == kind,
                                                  Graph.compile_id == "0/0"))
            seqs[kind] = [t for t, op in s.execute(select(InternedString.value, Node.op).join(
                Node, Node.target_id == InternedString.id).where(Node.graph_id == gid).order_by(Node.idx))
                if op == "call_function" and t.startswith("aten.")]
    return {"runs": out, "seqs": seqs, "engine": dst}


def write_trace(path: Path, seqs: dict, rank: int, slow: bool, slow_factor: float) -> int:
    rnd = random.Random(1000 + rank)
    base = {kind: [rnd.randint(2_000, 60_000) for _ in seq] for kind, seq in seqs.items()}
    slow_at = next(i for i, t in enumerate(seqs["aot_forward"]) if t.startswith("aten.addmm"))
    ev, t = [], 0

    def x(name, cat, ts, dur, args=None):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts / 1000, "dur": dur / 1000,
                   "args": args or {}})

    for step in range(STEPS):
        step_start, body = t, []
        t += 1_000
        for k in range(COMPILES):
            for kind, rng in (("aot_forward", "CompiledFunction"), ("aot_backward", "CompiledFunctionBackward")):
                ops = []
                t0 = t + 2_000
                tt = t0
                for i, target in enumerate(seqs[kind]):
                    dur = int(base[kind][i] * rnd.uniform(0.96, 1.04))
                    if slow and kind == "aot_forward" and k == 3 and i == slow_at:
                        dur = int(dur * slow_factor)
                    ops.append(("aten::" + target.split(".")[1], tt, dur))
                    tt += dur + 500
                seq_nr = 10_000 * step + k
                if kind == "aot_forward":
                    body.append(("Torch-Compiled Region: %d/0" % k, t, tt - t + 1_000, {}))
                body.append((rng, t0 - 500, tt - t0 + 700, {"Sequence number": seq_nr}))
                body.extend((n, a, d, {}) for n, a, d in ops)
                t = tt + 2_000
        x(f"ProfilerStep#{step}", "user_annotation", step_start, t - step_start)
        for name, ts, dur, args in body:
            x(name, "cpu_op", ts, dur, args)
        t += 1_000
    path.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms"}))
    return len(ev)


def _stats(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} | {max(xs) - min(xs):.3f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--keep", type=Path, default=None, help="keep the stores in this folder")
    p.add_argument("--reuse", action="store_true", help="with --keep: time the store built there by an earlier run")
    args = p.parse_args()
    from graphdeck.analysis.diff.runs import Gates, diff_runs
    from graphdeck.analysis.diff.text import to_text
    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run
    from graphdeck.store.traces import ingest_trace

    scratch = args.keep or Path(tempfile.mkdtemp(prefix="bench-diff-"))
    scratch.mkdir(parents=True, exist_ok=True)
    store = scratch / "diff.db"
    if not (args.reuse and store.exists()):
        t = time.perf_counter()
        src = capture_source(scratch)
        store.unlink(missing_ok=True)
        built = build_runs(src, store)
        n_events = 0
        import graphdeck.store.node_times as node_times

        record, kept = node_times.record, []

        def timed_record(*a, **k):  # measured, not changed: the ingest's share for the node-time table
            c = time.process_time()
            try:
                return record(*a, **k)
            finally:
                kept.append(time.process_time() - c)

        node_times.record = timed_record
        ingest_cpu = []
        for name, slow in (("bench_a", False), ("bench_b", True)):
            for r in range(RANKS):
                path = scratch / f"{name}_{r}.json"
                n_events += write_trace(path, built["seqs"], r, slow, 40.0)
                c = time.process_time()
                ingest_trace(built["engine"], path, run_name=name, rank=r, name=f"{name} rank {r}")
                ingest_cpu.append(time.process_time() - c)
                path.unlink()
        node_times.record = record
        built["engine"].dispose()
        print(f"setup {time.perf_counter() - t:.1f} s: {RANKS} ranks x {COMPILES * 3} graphs per run, "
              f"{n_events} trace events in all", flush=True)
        print("| ingest_trace per trace (16), CPU s | " + _stats(ingest_cpu) + " |")
        print("|   of which the node-time table (map + write), CPU s | " + _stats(kept) + " |")
        print("|   the rest (the ingest without the table), CPU s | "
              + _stats([a - b for a, b in zip(ingest_cpu, kept)]) + " |", flush=True)
    engine = open_engine(store, read_only=True)  # as the CLI and the server read it
    import graphdeck.analysis.diff.runs as run_diff_mod

    timing_cpu = [0.0]
    for fname in ("rank_times", "compare_rank"):  # measured, not changed: CPU of the node-time part
        def timed(*a, _f=getattr(run_diff_mod, fname), **k):
            c = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                timing_cpu[0] += time.process_time() - c
        setattr(run_diff_mod, fname, timed)
    part = []
    cpu, wall, child_cpu, child_wall = [], [], [], []
    report = None
    for _ in range(args.repeat):
        with Session(engine) as s:
            a = s.scalar(select(Run).where(Run.name == "bench_a"))
            b = s.scalar(select(Run).where(Run.name == "bench_b"))
            timing_cpu[0] = 0.0
            c0, w0 = time.process_time(), time.perf_counter()
            report = diff_runs(s, a, s, b, Gates(max_new_graph_breaks=0, max_node_regression_pct=50))
            to_text(report)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            part.append(timing_cpu[0])
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        w0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "graphdeck.cli", "diff-runs", str(store), "bench_a", "bench_b"],
                              capture_output=True, text=True)
        child_wall.append(time.perf_counter() - w0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        child_cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        assert proc.returncode == 0, proc.stderr[-2000:]
    kinds = report.to_dict()["summary"]
    print(f"verdict {report.verdict}; findings {kinds}; sections "
          + ", ".join(f"{k}={v['status']}" for k, v in report.sections.items()))
    rest = [c - t for c, t in zip(cpu, part)]
    # where the node times came from (NOTE: [Node-time table] in graphdeck/store/node_times.py)
    print("node times from:", dict(Counter(v for r in report.timing.values() for v in (r["times_a"], r["times_b"]))))
    for label, xs in (("diff_runs + text, in process, CPU s", cpu), ("diff_runs + text, in process, wall s", wall),
                      ("  of which node times (16 traces' node times read, 8 ranks compared), CPU s", part),
                      ("  of which everything else (compile, graphs, memory, ranks, grads), CPU s", rest),
                      ("graphdeck diff-runs (child), CPU s", child_cpu), ("graphdeck diff-runs (child), wall s", child_wall)):
        print(f"| {label} | {statistics.median(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} | {max(xs) - min(xs):.3f} |")


if __name__ == "__main__":
    main()
