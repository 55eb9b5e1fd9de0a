"""An N-rank run made from real inputs, for the scale benchmark and its CI test (issue 26 item 1).

Inputs (nothing here is invented from scratch; every row and event is a copy of a captured one):

* **Records** (graphs, nodes, edges, parameters, compile records, DDP bucket and process-group
  records, gradient steps): the 2-rank CPU run in ``tests/data/scale_cpu2/cpu2.db.gz``, captured
  by ``graphdeck demo --nproc 2 --backend aot_eager --steps 4`` (GPT-2, 2 layers, DDP over gloo,
  2 profiled steps; see its README). Rank r gets rank ``r % 2``'s rows; the process-group and
  communication-group records name the N-rank world. Its Flight Recorder records are left out
  (``bench/bench_flight.py`` measures those at 1,024 ranks).
* **Traces** (``traces=``): ``"cpu"`` — that run's own Kineto traces (gloo collectives on the
  CPU, ~4,300 events a rank), rebuilt as Kineto JSON from the stored events and metadata;
  ``"gpu"`` — the real 2 x H200 DDP traces of ``tests/data/ddp_h200x2`` (GPT-2 small under
  Inductor, 70 NCCL all-reduce kernels, ~25,400 events a rank), read as the files are. Rank r's
  trace is source rank ``r % 2``'s with ``distributedInfo`` naming rank r of N; its clock is
  shifted by a seeded offset of up to ±``clock_skew_us`` µs. ``events_per_rank`` resizes it: fewer
  keeps every collective, launch of a collective kernel and profiler step and a seeded sample of
  the rest; more repeats the profiled steps after the last one (steps renumbered, correlation ids
  made unique).

The scenario (all seeded, all named in the :class:`ScaleRun`):

* every rank but the **straggler** starts each collective ``delay_us`` earlier (plus up to
  ``jitter_us`` of seeded jitter; the straggler gets the jitter only) and waits longer in it, its
  end unchanged — the others wait for the straggler, as in a real job;
* the **divergent** rank's collective #``diverge_seq`` of group ``"0"`` moves twice the elements
  (``In msg nelems`` on a kernel, ``Input Dims`` on a gloo range), and its DDP
  communication-group record says bucket ``diverge_seq % buckets`` holds twice the bytes, so
  check-ranks' predicted schedule differs there too;
* the **missing** rank has every record but no trace.

Ingest is graphdeck's own (:func:`graphdeck.store.traces.ingest_trace`), in ``workers`` processes
writing into the one store (SQLite file or PostgreSQL URL); each worker writes a rank's file
(gzip), ingests it, deletes it and reports the ingest's own CPU and wall seconds.

    python bench/scale_harness.py STORE --ranks 64 [--traces gpu] [--events-per-rank 50000] [--seed 0]
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import random
import shutil
import sqlite3
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
CPU_STORE = ROOT / "tests" / "data" / "scale_cpu2" / "cpu2.db.gz"
GPU_TRACES = [ROOT / "tests" / "data" / "ddp_h200x2" / f"ddp_rank{r}.pt.trace.json.gz" for r in (0, 1)]
#: Compile records not copied to the N-rank run (Flight Recorder dumps of the 2-rank world).
LEFT_OUT_RECORDS = ("flight_recorder",)
#: Tables copied per rank by (run_id, rank) (graphs and their children are copied by graph).
RANK_TABLES = ("ranks", "params", "compile_events", "grad_steps")


@dataclass
class ScaleRun:
    """What :func:`make_scale_run` made: the store, the run and its scenario, and the ingest's
    measurements (``ingest``: per-rank ``(rank, cpu_s, wall_s, events)`` of the ingest alone)."""

    store: str
    run_name: str
    run_id: int
    n_ranks: int
    seed: int
    traces: str
    straggler: int
    divergent: int
    diverge_seq: int
    missing: int
    events_per_rank: int
    records_s: float = 0.0
    ingest_wall_s: float = 0.0
    link_s: float = 0.0
    ingest: list[tuple[int, float, float, int]] = field(default_factory=list)
    clock_offsets_us: dict[int, float] = field(default_factory=dict)

    @property
    def ingested_events(self) -> int:
        return sum(e for *_x, e in self.ingest)

    @property
    def ingest_cpu_s(self) -> float:
        return sum(c for _r, c, _w, _e in self.ingest)


# --------------------------------------------------------------------------- records


def _cols(db: sqlite3.Connection, table: str, drop: tuple[str, ...]) -> list[str]:
    return [f'"{c[1]}"' for c in db.execute(f"PRAGMA table_info({table})") if c[1] not in drop]


def _world_records(payload: str, name: str, n: int, rank: int, divergent: int, diverge_seq: int) -> str:
    doc = orjson.loads(payload)
    if name == "graphdeck_process_groups":
        for g in doc.get("groups") or []:
            g["ranks"] = list(range(n))
    elif name == "graphdeck_comm_groups":
        doc["world_size"] = n
        if rank == divergent:
            for ddp in doc.get("ddp") or []:
                buckets = ddp.get("buckets") or []
                if buckets:
                    b = buckets[diverge_seq % len(buckets)]
                    b["numel"], b["size_bytes"] = b["numel"] * 2, b["size_bytes"] * 2
    return orjson.dumps(doc).decode()


def build_records(path: Path, n: int, run_name: str, divergent: int, diverge_seq: int) -> int:
    """The N-rank records (module docstring) as a SQLite store at ``path`` (its traces left
    out); returns the run id. Rank r's graphs get ids ``id + r * stride`` so each table is copied
    with one statement per rank."""
    with gzip.open(CPU_STORE) as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    db = sqlite3.connect(path)
    db.execute("PRAGMA foreign_keys = OFF")
    (run_id,) = db.execute("SELECT id FROM runs ORDER BY id LIMIT 1").fetchone()
    db.execute("DELETE FROM trace_events")
    db.execute("DELETE FROM traces")
    db.execute("DELETE FROM kernel_nodes")
    db.execute(f"DELETE FROM compile_events WHERE name IN ({','.join('?' * len(LEFT_OUT_RECORDS))})", LEFT_OUT_RECORDS)
    db.execute("UPDATE runs SET name = ?, world_size = ? WHERE id = ?", (run_name, n, run_id))
    db.execute("UPDATE ranks SET world_size = ? WHERE run_id = ?", (n, run_id))
    (max_gid,) = db.execute("SELECT COALESCE(MAX(id), 0) FROM graphs").fetchone()
    stride = 10 ** len(str(max_gid + 1))
    gcols = _cols(db, "graphs", ("id", "rank", "parent_id"))
    child = {t: _cols(db, t, ("id", "graph_id")) for t in ("nodes", "edges", "graph_io")}
    pcols = _cols(db, "partitions", ("id", "rank", "parent_graph_id", "graph_id"))
    rcols = {t: _cols(db, t, ("id", "rank")) for t in RANK_TABLES}
    for r in range(2, n):
        s, off = r % 2, (r // 2) * stride
        for t in RANK_TABLES:
            cols = ", ".join(rcols[t])
            db.execute(f"INSERT INTO {t} (rank, {cols}) SELECT ?, {cols} FROM {t} WHERE run_id = ? AND rank = ?",
                       (r, run_id, s))
        db.execute(f"INSERT INTO graphs (id, rank, parent_id, {', '.join(gcols)}) SELECT id + ?, ?, parent_id + ?, "
                   f"{', '.join(gcols)} FROM graphs WHERE run_id = ? AND rank = ?", (off, r, off, run_id, s))
        for t, cols in child.items():
            c = ", ".join(cols)
            db.execute(f"INSERT INTO {t} (graph_id, {c}) SELECT graph_id + ?, {c} FROM {t} WHERE graph_id IN "
                       "(SELECT id FROM graphs WHERE run_id = ? AND rank = ?)", (off, run_id, s))
        c = ", ".join(pcols)
        db.execute(f"INSERT INTO partitions (rank, parent_graph_id, graph_id, {c}) SELECT ?, parent_graph_id + ?, "
                   f"graph_id + ?, {c} FROM partitions WHERE run_id = ? AND rank = ?", (r, off, off, run_id, s))
    rows = db.execute("SELECT id, rank, name, payload FROM compile_events WHERE run_id = ? AND name IN "
                      "('graphdeck_process_groups', 'graphdeck_comm_groups')", (run_id,)).fetchall()
    db.executemany("UPDATE compile_events SET payload = ? WHERE id = ?",
                   [(_world_records(p, name, n, r, divergent, diverge_seq), i) for i, r, name, p in rows])
    db.commit()
    db.execute("VACUUM")
    db.close()
    return run_id


# --------------------------------------------------------------------------- traces


def _num(x: str) -> int | str:
    return int(x) if x.lstrip("-").isdigit() else x


def cpu_source_docs() -> list[dict]:
    """The CPU run's two traces as Kineto JSON documents, rebuilt from its stored events
    (``X`` and ``i``; ts/dur in µs since ``baseTimeNanoseconds``) and metadata (process and
    thread names as ``M`` events)."""
    tmp = Path(tempfile.mkdtemp(prefix="gd-scale-src-"))
    try:
        path = tmp / "cpu2.db"
        with gzip.open(CPU_STORE) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        db = sqlite3.connect(path)
        docs = []
        for tid, meta_json in db.execute("SELECT id, meta_json FROM traces ORDER BY rank"):
            meta = orjson.loads(meta_json)
            base = int(meta.get("baseTimeNanoseconds") or 0)
            events = []
            for pid, name in (meta.get("process_names") or {}).items():
                events.append({"ph": "M", "name": "process_name", "pid": _num(pid), "tid": 0, "args": {"name": name}})
            for lane, name in (meta.get("thread_names") or {}).items():
                pid, t = lane.split("/")
                events.append({"ph": "M", "name": "thread_name", "pid": _num(pid), "tid": _num(t),
                               "args": {"name": name.split(" (", 1)[-1].rstrip(")")}})
            for ph, name, cat, ts, dur, pid, t, args in db.execute(
                    "SELECT e.ph, n.value, c.value, e.ts_ns, e.dur_ns, e.pid, e.tid, e.args_json FROM trace_events e "
                    "JOIN strings n ON n.id = e.name_id LEFT JOIN strings c ON c.id = e.cat_id "
                    "WHERE e.trace_id = ? ORDER BY e.id", (tid,)):
                ev = {"ph": ph, "cat": cat, "name": name, "pid": _num(pid), "tid": _num(t), "ts": (ts - base) / 1000}
                if ph == "X":
                    ev["dur"] = dur / 1000
                else:
                    ev["s"] = "t"
                if args:
                    ev["args"] = orjson.loads(args)
                events.append(ev)
            keep = ("schemaVersion", "deviceProperties", "record_shapes", "distributedInfo", "displayTimeUnit",
                    "baseTimeNanoseconds", "host_name")
            docs.append({**{k: meta[k] for k in keep if k in meta}, "traceEvents": events})
        db.close()
        return docs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gpu_source_docs() -> list[dict]:
    return [orjson.loads(gzip.open(p).read()) for p in GPU_TRACES]


def _is_comm(e: dict) -> bool:
    name = e.get("name", "")
    if e.get("ph") != "X":
        return False
    if e.get("cat") in ("kernel", "Kernel"):
        return name.startswith(("ncclDevKernel", "ncclKernel"))
    return name.startswith(("gloo:", "mpi:", "ucc:"))


def span_us(doc: dict) -> float:
    """First start to last end of ``doc``'s ``X`` events, plus 1 ms (µs): one repetition's length."""
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    return max(e["ts"] + e.get("dur", 0) for e in xs) - min(e["ts"] for e in xs) + 1000.0


def resize(doc: dict, events_per_rank: int | None, seed: int, repeat: int | None = None,
           span: float | None = None) -> dict:
    """``doc`` with about ``events_per_rank`` ``X`` events (module docstring): its profiled steps
    repeated ``repeat`` times (default: as many as reach ``events_per_rank``), then sampled down
    to ``events_per_rank`` keeping every collective, collective launch and step. The same ``doc``
    when both are None."""
    n0 = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X")
    if repeat is None and events_per_rank and events_per_rank > n0:
        repeat = math.ceil(events_per_rank / n0)
    if repeat and repeat > 1:  # ``span``: the same shift on every source rank (their ends stay matched)
        doc = _repeat(doc, repeat, span or span_us(doc))
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    if events_per_rank and events_per_rank < len(xs):
        doc = _sample(doc, xs, events_per_rank, seed)
    return doc


def _sample(doc: dict, xs: list[dict], n: int, seed: int) -> dict:
    comm_corr = {e.get("args", {}).get("correlation") for e in xs if _is_comm(e)} - {None}
    keep = {id(e) for e in xs if _is_comm(e) or e["name"].startswith("ProfilerStep#")
            or (e.get("args", {}).get("correlation") in comm_corr)}
    rest = [e for e in xs if id(e) not in keep]
    keep |= {id(e) for e in random.Random(seed).sample(rest, max(0, min(len(rest), n - len(keep))))}
    return {**doc, "traceEvents": [e for e in doc["traceEvents"] if e.get("ph") in ("M", "i") or id(e) in keep]}


def _repeat(doc: dict, copies: int, span: float) -> dict:
    evs = doc["traceEvents"]
    xs = [e for e in evs if e.get("ph") == "X"]
    steps = sorted({int(e["name"][13:]) for e in xs if e["name"].startswith("ProfilerStep#")})
    n_steps = (steps[-1] - steps[0] + 1) if steps else 0
    out = list(evs)
    for j in range(1, copies):
        for e in evs:
            if e.get("ph") not in ("X", "i"):
                continue  # flows and metadata once
            c = {**e, "ts": round(e["ts"] + j * span, 3)}
            if c["name"].startswith("ProfilerStep#"):
                c["name"] = f"ProfilerStep#{int(c['name'][13:]) + j * n_steps}"
            args = c.get("args")
            if args and ("correlation" in args or "External id" in args):
                args = dict(args)
                for k in ("correlation", "External id"):
                    if isinstance(args.get(k), int):
                        args[k] += j * 10_000_000
                c["args"] = args
            out.append(c)
    return {**doc, "traceEvents": out}


def source_docs(docs: list[dict], events_per_rank: int | None, seed: int, repeat: int | None = None) -> list[dict]:
    """The source ranks' documents resized alike (:func:`resize`, one repetition span for all)."""
    span = max(span_us(d) for d in docs)
    return [resize(d, events_per_rank, seed + i, repeat, span) for i, d in enumerate(docs)]


@dataclass
class _Plan:
    n: int
    seed: int
    straggler: int
    divergent: int
    diverge_seq: int
    delay_us: float
    jitter_us: float
    clock_skew_us: float


def transfer_times(docs: list[dict]) -> list[float] | None:
    """Per collective (the i-th of each source in start order), the shortest duration among the
    sources: the rank that arrived last waited for nobody, so its duration is the data's move
    alone. Every copy starts its collective that long before its end (then earlier by the
    scenario's delay and jitter), so the sources' own arrival order does not pick the straggler.
    None when the sources hold different numbers of collectives."""
    per = [[e["dur"] for e in sorted((e for e in d["traceEvents"] if _is_comm(e)), key=lambda e: e["ts"])]
           for d in docs]
    if len({len(p) for p in per}) != 1:
        return None
    return [min(ds) for ds in zip(*per)]


def _rank_rng(plan: _Plan, rank: int) -> tuple[random.Random, float]:
    """Rank ``rank``'s random source and (its first draw) its clock offset in µs."""
    rng = random.Random(plan.seed * 1_000_003 + rank)
    return rng, rng.uniform(-plan.clock_skew_us, plan.clock_skew_us)


def rank_doc(doc: dict, rank: int, plan: _Plan, transfer: list[float] | None = None) -> bytes:
    """Source ``doc`` made rank ``rank``'s (module docstring), as JSON bytes; ``transfer``:
    :func:`transfer_times` of the sources."""
    rng, off = _rank_rng(plan, rank)
    info = dict(doc.get("distributedInfo") or {})
    info.update(rank=rank, world_size=plan.n)
    info["pg_config"] = [{**g, "pg_size": plan.n, "ranks": list(range(plan.n))} for g in info.get("pg_config") or []]
    comm = sorted((e for e in doc["traceEvents"] if _is_comm(e)), key=lambda e: e["ts"])
    span: dict[int, tuple[int, float, float]] = {}  # id(event) -> (sequence, new ts, new dur), µs
    last = float("-inf")
    for i, e in enumerate(comm):
        early = rng.uniform(0, plan.jitter_us) + (plan.delay_us if rank != plan.straggler else 0.0)
        dur = transfer[i] if transfer is not None else e["dur"]
        end = e["ts"] + off + e["dur"]
        # Start order kept (collectives of one group on two gloo threads overlap): it is the order
        # they were issued in, and the order the matching reads.
        ts = max(end - dur - early, last + 0.001)
        span[id(e)] = (i, ts, end - ts)
        last = ts
    out = []
    for e in doc["traceEvents"]:
        if "ts" not in e:
            out.append(e)
            continue
        c = {**e, "ts": round(e["ts"] + off, 3)}  # Kineto writes µs with 3 decimals (ns)
        got = span.get(id(e))
        if got is not None:
            i, ts, dur = got
            c["ts"], c["dur"] = round(ts, 3), round(dur, 3)
            if rank == plan.divergent and i == plan.diverge_seq:
                args = dict(c.get("args") or {})
                if isinstance(args.get("In msg nelems"), int):
                    args["In msg nelems"] *= 2
                    args["Out msg nelems"] = args["In msg nelems"]
                dims = args.get("Input Dims")
                if isinstance(dims, list) and dims and isinstance(dims[0], list) and dims[0]:
                    args["Input Dims"] = [[dims[0][0] * 2, *dims[0][1:]], *dims[1:]]
                c["args"] = args
        out.append(c)
    return orjson.dumps({**doc, "distributedInfo": info, "traceEvents": out})


# --------------------------------------------------------------------------- ingest workers

_W: dict = {}


def _init_worker(store: str, source: str, events_per_rank: int | None, repeat: int | None, seed: int, plan: _Plan,
                 work: str) -> None:
    from graphdeck.store.db import open_engine

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    docs = cpu_source_docs() if source == "cpu" else gpu_source_docs()
    docs = source_docs(docs, events_per_rank, seed, repeat)
    _W.update(engine=open_engine(store), docs=docs, transfer=transfer_times(docs), plan=plan, work=Path(work))


def _ingest_rank(args: tuple[int, str]) -> tuple[int, float, float, int]:
    """Write rank ``rank``'s trace file, ingest it into run ``run_name``, delete it; (rank, ingest
    CPU s, ingest wall s, events stored)."""
    from isal import igzip

    from graphdeck.store.traces import ingest_trace

    rank, run_name = args
    path = _W["work"] / f"scale_rank{rank}.pt.trace.json.gz"
    with igzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(rank_doc(_W["docs"][rank % 2], rank, _W["plan"], _W["transfer"]))
    c0, w0 = time.process_time(), time.perf_counter()
    res = ingest_trace(_W["engine"], path, run_name=run_name)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    path.unlink()
    return rank, cpu, wall, res.num_events


def make_scale_run(store_url: str, n_ranks: int, seed: int = 0, *, traces: str = "gpu",
                   events_per_rank: int | None = None, repeat: int | None = None, workers: int = 2,
                   run_name: str = "scale",
                   straggler: int | None = None, divergent: int | None = None, diverge_seq: int = 5,
                   missing: int | None = None, delay_us: float = 3000.0, jitter_us: float = 200.0,
                   clock_skew_us: float = 5000.0, work_dir: str | os.PathLike | None = None) -> ScaleRun:
    """Make the N-rank run (module docstring) in ``store_url`` (a SQLite path, created and
    replaced, or an empty PostgreSQL database's URL). Straggler, divergent and missing ranks
    default to seeded distinct ranks (never 0, the clock reference). Deterministic from ``seed``
    (the rows and events; the ids and timings the ingest measures are not).

    Raises:
        ValueError: fewer than 4 ranks, ``traces`` not ``"cpu"``/``"gpu"``, or scenario ranks
            that are not distinct ranks of the run.
    """
    if n_ranks < 4:
        raise ValueError(f"n_ranks must be >= 4 (a straggler, a divergent and a missing rank), got {n_ranks}")
    if traces not in ("cpu", "gpu"):
        raise ValueError(f"traces must be 'cpu' or 'gpu', got {traces!r}")
    rng = random.Random(seed)
    picks = rng.sample(range(1, n_ranks), 3)
    straggler = picks[0] if straggler is None else straggler
    divergent = picks[1] if divergent is None else divergent
    missing = picks[2] if missing is None else missing
    if len({straggler, divergent, missing}) < 3 or not all(0 <= r < n_ranks for r in (straggler, divergent, missing)):
        raise ValueError(f"straggler {straggler}, divergent {divergent} and missing {missing} must be distinct ranks "
                         f"of 0..{n_ranks - 1}")
    from sqlalchemy import select

    from graphdeck.store.db import open_engine
    from graphdeck.store.schema import Run

    work = Path(work_dir or tempfile.mkdtemp(prefix="gd-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pg = "://" in store_url
    records = work / "records.db" if pg else Path(store_url)
    if not pg:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{records}{suffix}").unlink(missing_ok=True)
    build_records(records, n_ranks, run_name, divergent, diverge_seq)
    engine = open_engine(store_url)  # migrates the copied store to the head when it is older
    if pg:
        from graphdeck.store.merge import merge_store

        merge_store(records, engine, run_name=run_name)
        records.unlink()
    with engine.connect() as c:
        run_id = c.execute(select(Run.id).where(Run.name == run_name)).scalar_one()
    engine.dispose()
    records_s = time.perf_counter() - t0
    plan = _Plan(n_ranks, seed, straggler, divergent, diverge_seq, delay_us, jitter_us, clock_skew_us)
    ranks = [r for r in range(n_ranks) if r != missing]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker,
                             initargs=(store_url, traces, events_per_rank, repeat, seed, plan, str(work))) as pool:
        results = sorted(pool.map(_ingest_rank, [(r, run_name) for r in ranks], chunksize=1))
    ingest_wall = time.perf_counter() - t0
    from graphdeck.analysis.traces.mapping import link_kernels

    t0 = time.perf_counter()
    engine = open_engine(store_url)
    link_kernels(engine, run_id)
    engine.dispose()
    out = ScaleRun(store_url, run_name, run_id, n_ranks, seed, traces, straggler, divergent, diverge_seq, missing,
                   events_per_rank or 0, records_s, ingest_wall, time.perf_counter() - t0, results,
                   {r: _rank_rng(plan, r)[1] for r in ranks})
    if work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", help="SQLite path (replaced; its folder is made) or an empty PostgreSQL database's URL")
    ap.add_argument("--ranks", type=int, default=64, help="ranks of the run (>= 4: a straggler, a divergent and a "
                    "traceless rank among them)")
    ap.add_argument("--seed", type=int, default=0, help="picks those ranks, the clock offsets and the jitter")
    ap.add_argument("--traces", choices=["cpu", "gpu"], default="gpu", help="each rank's trace: the 2-rank CPU "
                    "run's gloo traces (small) or the real 2 x H200 DDP traces (steps repeated once: ~50k events a rank)")
    ap.add_argument("--events-per-rank", type=int, default=None, help="sample each trace to about this many "
                    "events, keeping every collective, its launch and every step (default: whole)")
    ap.add_argument("--workers", type=int, default=2, help="ingest processes")
    args = ap.parse_args()
    if "://" not in args.store:
        Path(args.store).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
    run = make_scale_run(args.store, args.ranks, args.seed, traces=args.traces,
                         events_per_rank=args.events_per_rank, workers=args.workers)
    print(f"run {run.run_name!r} (id {run.run_id}): {run.n_ranks} ranks, straggler {run.straggler}, divergent "
          f"{run.divergent} at collective #{run.diverge_seq} of group '0', missing {run.missing}; records "
          f"{run.records_s:.1f} s; {len(run.ingest)} traces, {run.ingested_events:,} events ingested in "
          f"{run.ingest_wall_s:.1f} s wall ({run.ingest_cpu_s:.1f} s CPU in the ingests); links {run.link_s:.1f} s")


if __name__ == "__main__":
    main()
