"""GPU → CPU links, analyses, kernel → node mapping, rank alignment, windows and the replay API,
checked against figures computed here directly from the trace files' events.
"""

from __future__ import annotations

import bisect
import gzip
import io
import json
import sqlite3
from collections import defaultdict
from decimal import Decimal

import httpx
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import TraceData, gpu_busy, overlap, step_times
from graphdeck.analysis.traces.collectives import align_and_match
from graphdeck.analysis.traces.mapping import map_trace, node_time_ns
from graphdeck.replay import TraceReplayer
from graphdeck.store.db import open_engine
from graphdeck.store.traces import ingest_trace
from tests.conftest import LiveServer, shared_path
from tests.trace_helpers import GPT2_TRACE, gpt2_store  # noqa: F401  (fixture)


def corpus(*parts):
    return shared_path("data", "traces", *parts)


def events_of(path) -> list[dict]:
    data = path.read_bytes()
    data = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    return json.loads(data, parse_float=Decimal)["traceEvents"]


def ns(us) -> int:
    return round(Decimal(str(us)) * 1000)


def merged_ns(intervals) -> int:
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0)


def test_t7_kernel_links_by_correlation_then_time_not_external_id(tmp_path):
    """Each kernel's operator is the innermost cpu_op on its launch's thread containing the launch
    (found here by a plain scan); joining on External id gets a large share wrong."""
    path = corpus("param-et_replay", "linear_kineto.json.gz")
    evs = events_of(path)
    runtime = {e["args"]["correlation"]: e for e in evs if e.get("cat") == "cuda_runtime"}
    ops_by_tid = defaultdict(list)
    for e in evs:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            ops_by_tid[(e["pid"], e["tid"])].append(e)
    for ops in ops_by_tid.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
    starts = {k: [e["ts"] for e in v] for k, v in ops_by_tid.items()}

    def innermost(rt):
        ops, st = ops_by_tid[(rt["pid"], rt["tid"])], starts[(rt["pid"], rt["tid"])]
        i = bisect.bisect_right(st, rt["ts"]) - 1
        best = None
        while i >= 0:
            op = ops[i]
            if op["ts"] + op["dur"] >= rt["ts"] + rt["dur"] and (best is None or op["dur"] < best["dur"]):
                best = op
                if op["ts"] < rt["ts"]:
                    break
            i -= 1
        return best

    kernels = [e for e in evs if e.get("cat") == "kernel"]
    want = {}
    for k in kernels:
        op = innermost(runtime[k["args"]["correlation"]])
        want[(k["name"], ns(k["ts"]))] = (op["name"], ns(op["ts"])) if op else None
    by_ext = {e["args"]["External id"]: e for v in ops_by_tid.values() for e in v}
    wrong = sum(1 for k in kernels if (o := by_ext.get(k["args"].get("External id"))) is not None
                and want[(k["name"], ns(k["ts"]))] != (o["name"], ns(o["ts"])))
    assert wrong / len(kernels) > 0.3, f"the External-id join is wrong for {wrong}/{len(kernels)} kernels (the trap)"

    engine = open_engine(tmp_path / "s.db")
    result = ingest_trace(engine, path, run_name="t7", strict=True)
    with Session(engine) as s:
        data = TraceData(s, result.trace_id)
    got = {}
    for link in data.links.values():
        if link.gpu.cat == "kernel":
            assert link.runtime is not None and link.runtime.corr == link.gpu.corr
            got[(link.gpu.name, link.gpu.ts)] = (link.op.name, link.op.ts) if link.op else None
    assert len(got) == len(kernels)
    bad = [k for k in want if got.get(k) != want[k]]
    assert not bad, f"{len(bad)} kernels linked to another operator than the innermost containing one, e.g. {bad[:2]}"


def test_gpu_busy_steps_and_overlap_are_sums_of_the_files_events(tmp_path):
    path = corpus("hta", "nccl_parser_config", "nccl_data.json.gz")
    evs = events_of(path)
    engine = open_engine(tmp_path / "s.db")
    result = ingest_trace(engine, path, run_name="sums", strict=True)
    base = int(json.loads(gzip.decompress(path.read_bytes()))["baseTimeNanoseconds"])
    kernels = [e for e in evs if e.get("cat") == "kernel"]
    gpu = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    with Session(engine) as s:
        data = TraceData(s, result.trace_id)
        busy = gpu_busy(data)
        steps = step_times(data)
        ov = overlap(data)
    assert sum(g["kernel_ns"] for g in busy) == sum(ns(e["dur"]) for e in kernels)
    assert sum(g["kernels"] for g in busy) == len(kernels)
    for g in busy:
        mine = [e for e in gpu if str(e["pid"]) == g["device"]]
        assert g["busy_ns"] == merged_ns((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])) for e in mine)
        assert g["idle_ns"] == g["window_ns"] - g["busy_ns"] and g["busy_ns"] <= g["kernel_ns"] + g["memcpy_ns"] + g["memset_ns"]
    runtime = {e["args"]["correlation"]: e for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    profiler_steps = sorted((e for e in evs if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    assert [st["cpu_dur_ns"] for st in steps] == [ns(e["dur"]) for e in profiler_steps]
    for st, e in zip(steps, profiler_steps):
        lo, hi = ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])
        mine = [k for k in kernels if lo <= ns(runtime[k["args"]["correlation"]]["ts"]) < hi]
        assert st["kernels"] == len(mine) and st["kernel_ns"] == sum(ns(k["dur"]) for k in mine)
        assert st["cpu_start_ns"] == base + lo
    comm = [k for k in kernels if k["name"].startswith("nccl")]
    comp = [k for k in kernels if not k["name"].startswith("nccl")]
    t = ov["trace"]
    assert t["comm_kernels"] == len(comm) and t["comm_kernel_ns"] == sum(ns(k["dur"]) for k in comm)
    cu = merged_ns((ns(k["ts"]), ns(k["ts"]) + ns(k["dur"])) for k in comm)
    both = cu + merged_ns((ns(k["ts"]), ns(k["ts"]) + ns(k["dur"])) for k in comp) - merged_ns(
        (ns(k["ts"]), ns(k["ts"]) + ns(k["dur"])) for k in kernels)
    assert t["comm_busy_ns"] == cu and t["overlap_ns"] == both and t["ratio"] == both / cu


def test_gpt2_h200_kernel_time_maps_to_graph_nodes(gpt2_store):  # noqa: F811
    """The H200 run (tests/data/gpt2_inductor): >= 95% of GPU kernel time maps to an FX node."""
    kernels = [e for e in events_of(GPT2_TRACE) if e.get("cat") == "kernel"]
    launches = [e for e in events_of(GPT2_TRACE) if e.get("cat") == "cpu_op" and "stream" in (e.get("args") or {})]
    with Session(open_engine(gpt2_store)) as s:
        m = map_trace(s, 1)
        data = TraceData(s, 1)
        busy = gpu_busy(data)
        times = node_time_ns(s, 2)
        graph_nodes = {r[0] for r in s.connection().exec_driver_sql("SELECT name FROM nodes WHERE graph_id = 2")}
    assert m.kernel_ns == sum(ns(k["dur"]) for k in kernels), "kernel time is the file's kernel sum"
    assert sum(g["kernel_ns"] for g in busy) == m.kernel_ns, (
        "Inductor's Triton-launch cpu_ops carry a 'stream' arg but are host time, never GPU time "
        f"({len(launches)} of them here)")
    assert len(launches) > 0
    frac = m.mapped_ns / m.kernel_ns
    assert frac >= 0.95, f"only {frac:.1%} of kernel time maps to a graph node; unmapped: {list(m.unmapped.items())[:5]}"
    assert sum(m.node_ns.values()) == m.mapped_ns, "per-node times add up to the mapped kernel time"
    assert times and set(times) <= graph_nodes | {n for n in times if n not in graph_nodes}
    assert sum(1 for n in times if n in graph_nodes) / len(times) > 0.9, "node-time keys are the graph's node names"


def _shifted(path, by_us: int) -> bytes:
    doc = json.loads(gzip.decompress(path.read_bytes()))
    for e in doc["traceEvents"]:
        if "ts" in e:
            e["ts"] += by_us
    return json.dumps(doc).encode()


def test_rank_clock_offsets_from_collective_ends(tmp_path):
    """The 2-rank HTA set; then rank 1's file with every ts moved +5000 µs (an edit made here):
    the estimated offset moves by exactly 5 ms and the matched collectives stay the same."""
    r0 = corpus("hta", "trace_filter", "sampled_rank-0.json.gz")
    r1 = corpus("hta", "trace_filter", "sampled_rank-1.json.gz")
    engine = open_engine(tmp_path / "s.db")
    runs = {}
    for run, second in (("plain", r1.read_bytes()), ("skewed", _shifted(r1, 5000))):
        ingest_trace(engine, r0, run_name=run, strict=True)
        runs[run] = ingest_trace(engine, io.BytesIO(second), run_name=run, rank=1, strict=True).run_id
    with Session(engine) as s:
        plain, skewed = (align_and_match(s, runs[k]) for k in ("plain", "skewed"))
    assert plain["offsets"][1]["method"] == "collective_end_median" and plain["offsets"][1]["matched"] == 10
    assert skewed["offsets"][1]["offset_ns"] - plain["offsets"][1]["offset_ns"] == 5_000_000
    assert [c["ranks"][1]["arrive_ns"] for c in plain["collectives"]] == [c["ranks"][1]["arrive_ns"] for c in skewed["collectives"]]
    kernel_dur = {ns(e["ts"]): ns(e["dur"]) for e in events_of(r0) if e.get("cat") == "kernel"}
    for c in plain["collectives"]:
        last = c["ranks"][c["last_rank"]]
        assert last["wait_ns"] == 0, "who arrived last waited for nobody"
        v0 = c["ranks"][0]
        assert v0["wait_ns"] + v0["transfer_ns"] in kernel_dur.values()
    assert {s["straggler"] for s in plain["stragglers"]} <= {0, 1}
    # These are 2 of 128 ranks, and their SendRecv kernels carry no process group: matching by
    # kind and sequence alone pairs kernels that cannot be one collective (a rank finished
    # before the other arrived). Such matches are flagged, checked here from the aligned times.
    for c in plain["collectives"]:
        ends = [v["end_ns"] for v in c["ranks"].values()]
        arrivals = [v["arrive_ns"] for v in c["ranks"].values()]
        assert (c["suspect"] is not None) == (max(arrivals) > min(ends)), c
    assert plain["suspect"] == sum(1 for c in plain["collectives"] if c["suspect"]) > 0


def test_window_level_of_detail_and_the_multi_rank_timeline_over_http(gpt2_store, tmp_path):  # noqa: F811
    engine = open_engine(tmp_path / "two.db")
    for r in (0, 1):
        ingest_trace(engine, corpus("hta", "trace_filter", f"sampled_rank-{r}.json.gz"), run_name="two", strict=True)
    n_x = sqlite3.connect(gpt2_store).execute("SELECT count(*) FROM trace_events WHERE trace_id=1 AND ph='X'").fetchone()[0]
    with LiveServer(gpt2_store) as srv:
        full = httpx.get(f"{srv.url}/api/traces/1/window", params={"max_shapes": 100}, timeout=60).json()
        meta = full["layout"]["meta"]
        assert meta["in_window"] == n_x and meta["shown_events"] == 100
        assert sum(len(t.get("x", [])) for t in full["data"] if t["type"] == "bar") <= 100
        zoom = httpx.get(f"{srv.url}/api/traces/1/window", params={"t0_ms": 10, "t1_ms": 10.5}, timeout=60).json()
        for t in zoom["data"]:
            for base, width in zip(t.get("base", []), t.get("x", [])):
                assert base < 10.5 and base + width >= 10, "every bar overlaps the window"
        assert zoom["layout"]["meta"]["in_window"] <= 2000
    with LiveServer(tmp_path / "two.db") as srv:
        fig = httpx.get(f"{srv.url}/api/runs/two/timeline", params={"max_shapes": 600}, timeout=60).json()
        assert fig["layout"]["meta"]["shown_events"] <= 600
        ticks = fig["layout"]["yaxis"]["ticktext"]
        first1 = next(i for i, t in enumerate(ticks) if t.startswith("rank 1"))
        assert all(t.startswith("rank 0") for t in ticks[:first1] if not t.startswith("·")), "ranks stacked in order"
        assert fig["layout"]["meta"]["offsets"]["1"]["method"] == "collective_end_median"
        colls = httpx.get(f"{srv.url}/api/runs/two/collectives", timeout=60).json()
        assert len(colls["collectives"]) == 10


def test_trace_replayer_replays_with_highlights_and_gives_analyses(gpt2_store):  # noqa: F811
    rp = TraceReplayer(trace_id=1, store=gpt2_store)
    plan = rp.replay(step_interval_ms=10, highlight_ops=["mm"])
    assert plan.url == "/#/traces/1/replay?step_interval_ms=10&highlight=mm&step=3"
    assert plan.step == 3 and plan.duration_ms == 10 * len(plan.frames)
    engine = open_engine(gpt2_store, read_only=True)
    with Session(engine) as s:
        kernels_step3 = step_times(TraceData(s, 1))[0]["kernels"]
    engine.dispose()
    assert len(plan.frames) == kernels_step3
    assert plan.highlighted and all("mm" in (f["kernel"] + (f["op"] or "") + (f["node"] or "")) for f in plan.highlighted)
    assert [f["t_ms"] for f in plan.frames] == sorted(f["t_ms"] for f in plan.frames)
    mapped = [f for f in plan.frames if f["node_idx"] is not None]
    assert len(mapped) / len(plan.frames) > 0.9
    a = rp.analyses()
    assert a["overlap"]["trace"]["reason"] == "no communication kernels" and a["overlap"]["trace"]["ratio"] is None
    assert a["mapping"]["mapped_fraction"] >= 0.95


def test_trace_replayer_ingests_a_file_once(tmp_path):
    path = corpus("deepseek-profile-data", "train.json")
    a = TraceReplayer(trace_file=path, store=tmp_path / "r.db")
    b = TraceReplayer(trace_file=path, store=tmp_path / "r.db")
    assert a.trace_id == b.trace_id, "the second replayer reuses the stored trace"
    assert isinstance(a.overlap(comm=[r"dpsk::ep::"])["trace"]["ratio"], float)


def test_identical_ranks_each_get_their_kernel_links(gpt2_store, tmp_path):  # noqa: F811
    """Two ranks that compile the same graphs write the same provenance tables, interleaved in the
    store: each rank gets its own kernel -> node links (on the 2 x H200 DDP run rank 1 got 2 rows
    against rank 0's 2,185, because a table already seen on rank 0 was skipped as a repeat)."""
    import shutil
    import sqlite3

    from graphdeck.analysis.traces.mapping import link_kernels

    path = tmp_path / "two_ranks.db"
    shutil.copy(gpt2_store, path)
    con = sqlite3.connect(path)
    graph_cols = [r[1] for r in con.execute("PRAGMA table_info(graphs)") if r[1] not in ("id", "rank", "parent_id")]
    node_cols = [r[1] for r in con.execute("PRAGMA table_info(nodes)") if r[1] not in ("id", "graph_id")]
    for (gid,) in con.execute("SELECT id FROM graphs WHERE rank = 0 ORDER BY id").fetchall():
        cur = con.execute(f"INSERT INTO graphs (rank, {', '.join(graph_cols)}) "
                          f"SELECT 1, {', '.join(graph_cols)} FROM graphs WHERE id = ?", (gid,))
        con.execute(f"INSERT INTO nodes (graph_id, {', '.join(node_cols)}) "
                    f"SELECT ?, {', '.join(node_cols)} FROM nodes WHERE graph_id = ?", (cur.lastrowid, gid))
    events = con.execute("SELECT id, run_id, name, compile_id, metadata_json, payload FROM compile_events "
                         "WHERE rank = 0 ORDER BY id").fetchall()
    con.execute("DELETE FROM compile_events")
    for _id, run, name, cid, meta, payload in events:  # rank 1 writes each record just before rank 0
        for rank in (1, 0):
            con.execute("INSERT INTO compile_events (run_id, rank, name, compile_id, metadata_json, payload) "
                        "VALUES (?, ?, ?, ?, ?, ?)", (run, rank, name, cid, meta, payload))
    con.commit()
    engine = open_engine(path)
    stats = link_kernels(engine, 1)
    engine.dispose()
    per_rank = dict(con.execute("SELECT rank, count(*) FROM kernel_nodes "
                                "WHERE source LIKE 'inductor_provenance_v2%' GROUP BY rank").fetchall())
    con.close()
    assert per_rank[0] > 1000 and per_rank[0] == per_rank[1], (per_rank, stats)
