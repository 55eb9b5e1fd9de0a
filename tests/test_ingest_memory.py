"""The ingest's post-ingest analyses (the collective index, the kept kernel links) read the stored
trace a few profiler steps at a time (NOTE: [Bounded launch sweep], issue 36 item 9): what they
keep is what reading the whole trace gives, and their memory does not grow with the trace."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import tracemalloc
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import step_times
from graphdeck.analysis.traces.collectives import INDEX_KEY, INDEX_VERSION, CollectiveData, rank_collectives
from graphdeck.analysis.traces.data import load_events
from graphdeck.analysis.traces.export_map import METHOD, encode
from graphdeck.analysis.traces.links import _chains
from graphdeck.analysis.traces.mapping import link_kernels
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Trace, TraceLinks
from graphdeck.store.traces import ingest_trace

DDP = Path(__file__).parent / "data" / "ddp_h200x2"
STEP_US = 10_000


def synthetic_trace(steps: int, ops: int = 60, late: dict[int, int] | None = None, shared_corr: bool = False) -> dict:
    """A GPU trace of ``steps`` ``ProfilerStep#N`` ranges, each with ``ops`` ``aten::mm`` launching a
    kernel that runs 3-8.4 ms later (often in the next step), a ``cudaStreamSynchronize`` (no
    kernel), an NCCL all-reduce under ``record_param_comms`` and a kernel no launch call names.
    ``late``: step → steps its all-reduce runs after its launch; ``shared_corr``: a launch call
    at the end repeats the first correlation id."""
    ev: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "host"}}]
    corr, t = 1, 1_000_000
    for s in range(steps):
        t0 = t + s * STEP_US
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": t0,
                   "dur": STEP_US - 10})
        for j in range(ops):
            ts = t0 + 5 + j * 150
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts, "dur": 100})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": ts + 10, "dur": 20, "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": f"gemm_{j % 5}", "pid": 0, "tid": 7,
                       "ts": ts + 3000 + (j % 7) * 900, "dur": 50, "args": {"correlation": corr, "stream": 7}})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 2,
                       "ts": ts + 40, "dur": 5, "args": {"correlation": corr + 1}})
            corr += 2
        ts = t0 + 9500
        ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": ts, "dur": 80,
                   "args": {"Collective name": "allreduce", "Process Group Name": "0"}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts + 5,
                   "dur": 10, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 9,
                   "ts": ts + 300 + (late or {}).get(s, 0) * STEP_US, "dur": 400,
                   "args": {"correlation": corr, "Process Group Name": "0", "Collective name": "allreduce",
                            "In msg nelems": 1024}})
        corr += 1
        ev.append({"ph": "X", "cat": "kernel", "name": "orphan_kernel", "pid": 0, "tid": 7, "ts": t0 + 9900, "dur": 5,
                   "args": {"correlation": 10_000_000 + s}})
    if shared_corr:
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 3,
                   "ts": t + (steps - 1) * STEP_US + 20, "dur": 5, "args": {"correlation": 1}})
    return {"traceEvents": ev, "distributedInfo": {"rank": 0, "world_size": 2, "backend": "nccl"}}


def whole_trace_results(engine, trace_id: int) -> tuple[dict, str | None, tuple]:
    """The collective index and kernel links as the whole trace in memory gives them (the list
    paths: every kernel and launch loaded, as before NOTE: [Bounded launch sweep])."""
    from graphdeck.analysis.traces.export_map import _compute
    from graphdeck.analysis.traces.launch_sweep import launches

    with Session(engine) as s:
        data = CollectiveData(s, trace_id)
        index = {"v": INDEX_VERSION, "collectives": [{**c, "key": list(c["key"])} for c in rank_collectives(data)],
                 "steps": step_times(data)}
        events = load_events(s, trace_id, with_args=False)
        by_kernel, comm, cpu_path = _compute(s, s.get(Trace, trace_id), launches(events, _chains))
        links = None if cpu_path else encode(trace_id, by_kernel, comm)
        ids = [e.id for e in events]
        return json.loads(json.dumps(index)), links, (len(ids), min(ids), max(ids))


def stored_results(engine, trace_id: int) -> tuple[dict, str | None, tuple]:
    with Session(engine) as s:
        trace = s.get(Trace, trace_id)
        row = s.execute(select(TraceLinks).where(TraceLinks.trace_id == trace_id, TraceLinks.method == METHOD)).scalar()
        fingerprint = (row.events_count, row.first_event_id, row.last_event_id) if row is not None else None
        return json.loads(trace.stats_json)[INDEX_KEY], row.links_json if row is not None else None, fingerprint


def check_kept_as_whole(store: str, path: Path) -> int:
    """Ingest ``path`` into ``store``; assert the kept index and links are the whole-trace ones;
    the trace's id."""
    engine = open_engine(store)
    res = ingest_trace(engine, path, run_name="r")
    index, links, fingerprint = stored_results(engine, res.trace_id)
    want_index, want_links, want_fingerprint = whole_trace_results(engine, res.trace_id)
    engine.dispose()
    assert index == want_index and len(index["steps"]) == 12 and len(index["collectives"]) == 12
    assert links == want_links and json.loads(links)["comm"] and fingerprint == want_fingerprint
    return res.trace_id


def check_sweep(store: str, trace_id: int, caplog, mark_events: int | None = None) -> bool:
    """The bounded sweep's launches (kernel, launch call, host ranges) are the list path's; whether
    it had to read the trace again (``mark_events``: run one :class:`Sweep` with that count instead
    and return whether its check failed)."""
    from graphdeck.analysis.traces.launch_sweep import Sweep, bounded, launches, stream_events

    def ids(items):
        return [(k.id, rt.id if rt is not None else None, tuple(e.id for e in chain)) for k, rt, chain in items]

    engine = open_engine(store)
    with Session(engine) as s:
        want = ids(launches(load_events(s, trace_id, with_args=False), _chains))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="graphdeck.analysis.traces.launch_sweep"):
            if mark_events is None:
                got = bounded(s, trace_id, ids, mark_events=100)  # the step horizon (3 steps) is the longer
                again = "read again" in caplog.text
            else:
                sweep = Sweep(mark_events=mark_events)
                got = ids(sweep.run(stream_events(s, trace_id)))
                again = not sweep.check(s, trace_id)
                if not again:
                    assert got == want
                got = want if again else got
    engine.dispose()
    assert got == want and sum(1 for _, rt, chain in want if rt is not None and chain) > 600
    return again


CASES = [("steps", {}, False),
         ("an all-reduce six steps late", {"late": {3: 6}}, True),
         ("a correlation id used twice", {"shared_corr": True}, True)]


@pytest.mark.parametrize("case, kwargs, read_again", CASES)
def test_streamed_index_links_and_launches_are_the_whole_trace_ones(case, kwargs, read_again, tmp_path, caplog):
    """A 12-step trace: the index and links kept at ingest equal the whole-trace ones, and so do
    the bounded sweep's launches and host ranges (what the links of a rank with kernel tables
    read). A kernel further than the horizon from its launch, or a correlation id two launches
    share, is noticed and the trace read again whole; a trace without step ranges is cut every
    ``mark_events`` events instead."""
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(synthetic_trace(12, **kwargs)))
    store = str(tmp_path / "s.db")
    trace_id = check_kept_as_whole(store, path)
    assert check_sweep(store, trace_id, caplog) == read_again, case
    with open_engine(store).begin() as c:  # no step ranges: the horizon counts events
        c.execute(text("UPDATE trace_events SET name_id = (SELECT name_id FROM trace_events WHERE name_id IN "
                       "(SELECT id FROM strings WHERE value = 'aten::mm') LIMIT 1) WHERE name_id IN "
                       "(SELECT id FROM strings WHERE value LIKE 'ProfilerStep#%')"))
    assert check_sweep(store, trace_id, caplog, mark_events=300) == read_again, case


def test_streamed_on_postgresql(pg_url, tmp_path, caplog):
    """The same on PostgreSQL (server-side cursors, the grouped launch join), with and without
    reading again."""
    for _case, kwargs, read_again in CASES[:2]:
        path = tmp_path / "trace.json"
        path.write_text(json.dumps(synthetic_trace(12, **kwargs)))
        assert check_sweep(pg_url, check_kept_as_whole(pg_url, path), caplog) == read_again


def test_streamed_links_with_kernel_tables_are_the_whole_trace_ones(tmp_path):
    """The 2 x H200 DDP GPT-2 store (Inductor kernel tables: the links read every host range):
    the links and index the ingest keeps equal the whole-trace ones on both ranks."""
    store = tmp_path / "ddp.db"
    with gzip.open(DDP / "ddp.db.gz") as src, open(store, "wb") as dst:
        shutil.copyfileobj(src, dst)
    engine = open_engine(store)
    link_kernels(engine, 1)  # before the ingest, so its links use the tables
    for rank in (0, 1):
        res = ingest_trace(engine, DDP / f"ddp_rank{rank}.pt.trace.json.gz", run_name="ddp", strict=True)
        index, links, fingerprint = stored_results(engine, res.trace_id)
        want_index, want_links, want_fingerprint = whole_trace_results(engine, res.trace_id)
        assert index == want_index and links == want_links and fingerprint == want_fingerprint
        assert len(json.loads(links)["kernels"]) > 1000  # kernels mapped through the tables


def test_ingest_memory_does_not_grow_with_the_steps(tmp_path):
    """The ingest's peak Python memory for 80 steps (19,600 events) is under 2x its peak for 20
    steps (4,900): it holds a few steps, not the trace (issue 36 item 9). Not timed: tracemalloc
    counts the bytes. Measured: 2.9 → 2.4 MiB (0.8x); the whole-trace reading before gave 2.9 →
    8.1 MiB (2.8x). The same for the bounded sweep that the links of a rank with kernel tables
    read (NOTE: [Bounded launch sweep]): 0.49 → 0.50 MiB, where the list path it replaces at
    ingest takes 2.5 → 9.8 MiB."""
    engine = open_engine(tmp_path / "s.db")
    sizes, traces = {}, {}
    for steps in (2, 20, 80):  # the first warms imports and caches up
        path = tmp_path / f"t{steps}.json"
        path.write_text(json.dumps(synthetic_trace(steps)))
        tracemalloc.start()
        try:
            traces[steps] = ingest_trace(engine, path, run_name=f"r{steps}", batch_size=500).trace_id
            sizes[steps] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert sizes[80] < 2 * sizes[20], {n: round(v / 2**20, 2) for n, v in sizes.items()}

    from graphdeck.analysis.traces.launch_sweep import bounded, launches

    sweep, whole = {}, {}
    for steps, trace_id in traces.items():
        with Session(engine) as s:
            tracemalloc.start()
            try:
                assert bounded(s, trace_id, lambda ks: sum(1 for _ in ks), mark_events=100) == steps * 62
                sweep[steps] = tracemalloc.get_traced_memory()[1]
                tracemalloc.reset_peak()
                assert sum(1 for _ in launches(load_events(s, trace_id, with_args=False), _chains)) == steps * 62
                whole[steps] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    mib = {k: {n: round(v / 2**20, 2) for n, v in d.items()} for k, d in (("sweep", sweep), ("whole", whole))}
    assert sweep[80] < 2 * sweep[20] and whole[80] > 3 * whole[20], mib


def ddp_copies(src: Path, out: Path, copies: int) -> Path:
    """The DDP rank's trace ``copies`` times end to end, each copy's times shifted past the previous
    one's and its launch ids (``correlation``, ``External id``) past the previous copy's, as one long
    profile numbers them (bench/bench_upload_memory.py's inputs)."""
    doc = json.loads(gzip.decompress(src.read_bytes()))
    events = doc.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    timed = [e for e in events if e.get("ph") != "M" and isinstance(e.get("ts"), (int, float))]
    span = int(max(e["ts"] + (e.get("dur") or 0) for e in timed) - min(e["ts"] for e in timed)) + 1000
    keys = {"correlation", "External id"}
    ids = 1 + max(v for e in timed for a, v in (e.get("args") or {}).items() if a in keys and isinstance(v, int))
    doc["traceEvents"] = meta + [
        {**e, "ts": e["ts"] + k * span, **({"args": {a: v + k * ids if a in keys and isinstance(v, int) else v
                                                      for a, v in e["args"].items()}} if e.get("args") else {})}
        for k in range(copies) for e in timed]
    out.write_text(json.dumps(doc))
    return out


def test_node_times_with_kernel_tables_do_not_grow_with_the_trace(tmp_path):
    """A rank with Inductor kernel tables (the 2 x H200 DDP store's rank 0, 5 host steps, its trace
    once and four times end to end): the ingest's node-time hook (:func:`graphdeck.store.node_times.
    record` given the links' ``by_kernel``) streams the kernels into per-step sums, so its peak
    Python memory is under 1.5x from 1 to 4 copies (it loaded every event before: ~600 bytes an
    event, 4x); the rows it keeps are those of the loaded path (``trace_node_times`` mapping the
    whole trace itself). Not timed: tracemalloc counts the bytes."""
    from graphdeck.analysis.diff.times import trace_node_times
    from graphdeck.analysis.traces.export_map import record_links
    from graphdeck.store import node_times

    store = tmp_path / "ddp.db"
    with gzip.open(DDP / "ddp.db.gz") as src, open(store, "wb") as dst:
        shutil.copyfileobj(src, dst)
    engine = open_engine(store)
    link_kernels(engine, 1)
    peak = {}
    for copies in (1, 4):
        path = ddp_copies(DDP / "ddp_rank0.pt.trace.json.gz", tmp_path / f"x{copies}.json", copies)
        trace_id = ingest_trace(engine, path, run_name="ddp", strict=True).trace_id
        by_kernel = record_links(engine, trace_id, full=True)
        assert by_kernel and len(by_kernel) > 1000 * copies
        tracemalloc.start()
        try:
            assert node_times.record(engine, trace_id, by_kernel)
            peak[copies] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        with Session(engine) as s:
            trace = s.get(Trace, trace_id)
            got, _why = node_times.load(s, trace_id, trace.run_id, trace.rank)
            want = trace_node_times(s, trace.run_id, trace.rank, trace_id)  # maps the loaded events itself
        assert got is not None and want.steps == got.steps == 5 * copies and want.source == got.source
        assert (want.mapped_calls, want.unmapped_calls) == (got.mapped_calls, got.unmapped_calls)
        rows = {n: (t, c, list(r)) for n, t, c, r in zip(got.nodes, got.total_ns.tolist(), got.count.tolist(),
                                                          got.step_ns.tolist())}
        assert rows == {n: (t, c, list(r)) for n, t, c, r in zip(want.nodes, want.total_ns.tolist(),
                                                                  want.count.tolist(), want.step_ns.tolist())}
        assert len(rows) > 100
    engine.dispose()
    assert peak[4] < 1.5 * peak[1], {n: round(v / 2**20, 2) for n, v in peak.items()}
