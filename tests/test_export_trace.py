"""``graphdeck export-trace`` and ``GET /api/runs/{id}/export-trace`` (issue 26 item 3; NOTE: [Trace
export] in analysis/traces/export.py) on real multi-rank stores: the 2 x H200 DDP run of
tests/data/ddp_h200x2 (GPT-2 under Inductor, both ranks' Kineto traces ingested and the kernel →
node links rebuilt, as tests/test_h200x2.py does) and HTA's sampled 2-rank NCCL traces from
../shared/data/traces (no graphs). The file is checked structurally against the Trace Event
Format (required fields per phase, metadata, flow pairs bound to enclosing slices) and ingested
again: the same events per rank at their aligned times."""

from __future__ import annotations

import bisect
import gzip
import io
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import orjson
import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.collectives import align_and_match
from graphdeck.analysis.traces.data import load_events
from graphdeck.analysis.traces.export import CHUNK_BYTES, export_trace, iter_export, parse_ranks, plan_export
from graphdeck.analysis.traces.export_map import kernel_links, refresh_links, stored_links
from graphdeck.analysis.traces.mapping import link_kernels, map_trace
from graphdeck.cli import main
from graphdeck.errors import UsageError
from graphdeck.store.db import open_engine
from graphdeck.store.merge import merge_store
from graphdeck.store.schema import Trace
from graphdeck.store.traces import ingest_trace
from tests.conftest import LiveServer, shared_path

DATA = Path(__file__).parent / "data" / "ddp_h200x2"
HTA = ("data", "traces", "hta", "trace_filter")
NUMBER = (int, float)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    """The DDP store, its full export (CLI) and the events per rank of the original traces."""
    tmp = tmp_path_factory.mktemp("ddp_export")
    path = tmp / "ddp.db"
    with gzip.open(DATA / "ddp.db.gz") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    engine = open_engine(path)
    for rank in (0, 1):
        ingest_trace(engine, DATA / f"ddp_rank{rank}.pt.trace.json.gz", run_name="ddp", strict=True)
    link_kernels(engine, 1)
    out = tmp / "all.trace.json.gz"
    res = CliRunner().invoke(main, ["export-trace", str(path), "--run", "ddp", "-o", str(out)])
    assert res.exit_code == 0, res.output
    with Session(engine) as s:
        aligned = align_and_match(s, 1)
        traces = dict(s.execute(text("SELECT rank, id FROM traces ORDER BY rank")).all())
        full = {r: map_trace(s, t) for r, t in traces.items()}
        mapped = {r: len(m.by_kernel) for r, m in full.items()}
        links = {r: (list(m.by_kernel.items()), list(m.comm_label.items())) for r, m in full.items()}
        fast = {r: tuple(list(d.items()) for d in kernel_links(s, t, load_events(s, t))) for r, t in traces.items()}
    engine.dispose()
    return {"store": path, "tmp": tmp, "file": out, "doc": orjson.loads(gzip.open(out).read()), "cli": res.output,
            "aligned": aligned, "traces": traces, "mapped": mapped, "original": _stored_events(path, traces),
            "links": links, "fast_links": fast}


def _stored_events(store: Path, traces: dict[int, int]) -> dict[int, Counter]:
    """rank (or pid) → Counter of (ph, name, ts_ns, dur_ns) of the stored events (slices and
    instants: the kept forward→backward flow ends are not exported, NOTE: [Forward-backward flows])."""
    engine = open_engine(store, read_only=True)
    out = {}
    with engine.connect() as c:
        for key, tid in traces.items():
            out[key] = Counter(c.execute(text(
                "SELECT e.ph, n.value, e.ts_ns, e.dur_ns FROM trace_events e JOIN strings n ON n.id = e.name_id "
                "WHERE e.trace_id = :t AND e.ph IN ('X', 'i', 'I')"), {"t": tid}).all())
    engine.dispose()
    return out


def validate_trace_events(doc: dict) -> dict:
    """Structural check of a Chrome Trace Event Format document (JSON Object Format); returns
    counts per phase. Fails the test on the first violation."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    phases: Counter = Counter()
    slices: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    named_procs, named_threads, lanes, flows = {}, set(), set(), defaultdict(list)
    for ev in doc["traceEvents"]:
        ph = ev.get("ph")
        phases[ph] += 1
        assert ph in ("X", "i", "M", "s", "f"), ev
        assert isinstance(ev.get("pid"), int) and isinstance(ev.get("tid"), int), ev
        assert isinstance(ev.get("name"), str) and ev["name"], ev
        if ph == "M":
            assert ev["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), ev
            assert isinstance(ev.get("args"), dict), ev
            if ev["name"] == "process_name":
                named_procs[ev["pid"]] = ev["args"]["name"]
            if ev["name"] == "thread_name":
                assert isinstance(ev["args"]["name"], str) and ev["args"]["name"]
                named_threads.add((ev["pid"], ev["tid"]))
            continue
        assert isinstance(ev.get("ts"), NUMBER) and not isinstance(ev["ts"], bool), ev
        if "args" in ev:
            assert isinstance(ev["args"], dict), ev
        if ph == "X":
            assert isinstance(ev.get("dur"), NUMBER) and ev["dur"] >= 0, ev
            slices[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
        elif ph == "i":
            assert ev.get("s", "t") in ("g", "p", "t"), ev
        else:
            assert isinstance(ev.get("id"), int) and isinstance(ev.get("cat"), str), ev
            if ph == "f":
                assert ev.get("bp") == "e", ev
            flows[ev["id"]].append(ev)
        lanes.add((ev["pid"], ev["tid"]))
    assert lanes <= named_threads, f"lanes without thread_name: {sorted(lanes - named_threads)[:5]}"
    assert {p for p, _ in lanes} <= set(named_procs)
    for pid, name in named_procs.items():
        assert name == f"rank {pid}"
    starts = {k: sorted(v) for k, v in slices.items()}
    for fid, pair in flows.items():
        assert sorted(e["ph"] for e in pair) == ["f", "s"], (fid, pair)
        assert pair[0]["pid"] != pair[1]["pid"], pair  # across ranks
        s_ev, f_ev = sorted(pair, key=lambda e: e["ph"] != "s")
        assert s_ev["ts"] <= f_ev["ts"], pair  # Perfetto drops a flow whose f comes before its s
        for e in pair:  # bound to a slice enclosing its ts on its own thread
            lane = starts[(e["pid"], e["tid"])]
            i = bisect.bisect_right(lane, (e["ts"], float("inf")))
            assert any(s <= e["ts"] <= t for s, t in lane[max(0, i - 50):i]), e
    return {"phases": phases, "flows": len(flows), "ranks": sorted(named_procs)}


def _events_by_rank(store: Path, run: str) -> dict[int, Counter]:
    """rank → Counter of (ph, name, ts_ns, dur_ns) of run ``run``'s stored events, by the rank of
    the trace that holds them; asserts one trace per rank whose events all come from that rank's pid."""
    engine = open_engine(store, read_only=True)
    with engine.connect() as c:
        traces = c.execute(text("SELECT t.rank, t.id FROM traces t JOIN runs r ON r.id = t.run_id "
                                "WHERE r.name = :run"), {"run": run}).all()
        pids = c.execute(text("SELECT t.rank, e.pid FROM trace_events e JOIN traces t ON t.id = e.trace_id "
                              "GROUP BY t.rank, e.pid")).all()
    engine.dispose()
    assert len({r for r, _ in traces}) == len(traces), traces  # one trace per rank
    assert all(int(pid) == r for r, pid in pids), pids  # each rank's events, nobody else's
    return _stored_events(store, dict(traces))


def _reingest(export: Path, store: Path, run: str) -> str:
    """``graphdeck ingest-trace`` of an export, as the docs say (docs/large-runs.md)."""
    res = CliRunner().invoke(main, ["ingest-trace", str(export), "--run", run, "--store", str(store), "--strict"])
    assert res.exit_code == 0, res.output
    return res.output


def test_export_is_valid_trace_event_format(ddp):
    doc = ddp["doc"]
    got = validate_trace_events(doc)
    assert got["ranks"] == [0, 1]
    n_orig = sum(sum(c.values()) for c in ddp["original"].values())
    assert got["phases"]["X"] + got["phases"]["i"] == n_orig
    # One flow per matched collective from the rank that arrived last to the one that waited.
    matched = [c for c in ddp["aligned"]["collectives"] if len(c["ranks"]) == 2]
    assert got["flows"] == len(matched) == doc["graphdeck"]["collectives_linked"] == 70
    assert "70 collectives linked by 70 flows" in ddp["cli"]
    # Offsets are the run timeline's (align_and_match's).
    for r, o in ddp["aligned"]["offsets"].items():
        assert doc["graphdeck"]["offsets"][str(r)]["offset_ns"] == o["offset_ns"]
        assert doc["graphdeck"]["offsets"][str(r)]["method"] == o["method"]


def test_reingest_gives_the_same_events_per_rank_at_aligned_times(ddp):
    """``ingest-trace`` of the export (NOTE: [Export re-ingest]): one trace per rank, each with the
    events the export holds for it, at the aligned times; the offset applied is in its meta."""
    store = ddp["tmp"] / "again.db"
    out = _reingest(ddp["file"], store, "again")
    assert "a graphdeck export of 2 ranks (0-1)" in out and "rank 0, status ok" in out and "rank 1, status ok" in out
    again = _events_by_rank(store, "again")
    assert sorted(again) == [0, 1]
    per_pid = Counter(ev["pid"] for ev in ddp["doc"]["traceEvents"] if ev["ph"] in ("X", "i"))
    for r, orig in ddp["original"].items():
        off = ddp["aligned"]["offsets"][r]["offset_ns"]
        shifted = Counter({(ph, name, ts - off, dur): n for (ph, name, ts, dur), n in orig.items()})
        assert sum(again[r].values()) == sum(orig.values()) == per_pid[r], r
        assert Counter(n for _, n, _, _ in again[r].elements()) == Counter(n for _, n, _, _ in orig.elements()), r
        assert again[r] == shifted, (r, list((again[r] - shifted).items())[:3])
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        for t in s.query(Trace).all():
            meta = orjson.loads(t.meta_json)["graphdeck_export"]
            assert meta["run"] == "ddp" and meta["rank"] == t.rank and meta["source"] == ddp["file"].name
            assert meta["offset_ns"] == ddp["aligned"]["offsets"][t.rank]["offset_ns"]
        assert len(align_and_match(s, 1)["offsets"]) == 2  # the cross-rank analyses see both ranks
    engine.dispose()


def test_node_names_modules_and_source_lines_in_args(ddp):
    per_rank: Counter = Counter()
    labels = 0
    for ev in ddp["doc"]["traceEvents"]:
        args = ev.get("args") or {}
        if "fx_nodes" in args:
            per_rank[ev["pid"]] += 1
            assert isinstance(args["fx_graph"], int) and all(isinstance(n, str) for n in args["fx_nodes"])
            assert ev["ph"] == "X" and ev.get("cat") == "kernel"
            if "source" in args:
                assert len(args["source"]) == len(args["fx_nodes"])
        if ev.get("name", "").startswith("nccl") and "collective" in args:
            labels += 1
            assert "fx_nodes" in args  # the parameters' nodes the bucket carries
    assert dict(per_rank) == ddp["mapped"], (per_rank, ddp["mapped"])
    kernels = [e for e in ddp["doc"]["traceEvents"] if "source" in (e.get("args") or {})]
    assert len(kernels) > 1000 and any("modeling_gpt2.py:" in s for e in kernels for s in e["args"]["source"] if s)
    assert any(m for e in kernels for m in e["args"].get("nn_modules", []) if m and m.startswith("transformer"))
    assert labels == 140  # 70 DDP bucket all-reduces per rank


def test_export_kernel_links_are_map_traces(ddp):
    """NOTE: [Export kernel links]: the export's cheaper links are map_trace's, key for key, in order."""
    for r, (by_kernel, labels) in ddp["links"].items():
        assert len(by_kernel) > 1000 and len(labels) == 70, r
        assert ddp["fast_links"][r] == (by_kernel, labels), r


def _export_bytes(store: Path, run: str, read_only: bool = False) -> tuple[bytes, dict]:
    engine = open_engine(store, read_only=read_only)
    buf = io.BytesIO()
    with Session(engine) as s:
        got = export_trace(s, s.execute(text("SELECT id FROM runs WHERE name = :n"), {"n": run}).scalar(), buf)
    engine.dispose()
    return buf.getvalue(), got


def test_links_kept_at_ingest_are_used_and_stale_ones_recomputed(ddp):
    """NOTE: [Stored kernel links]: the links kept at ingest give the same bytes as links computed
    from the events; a row made stale (kernel links changed, the row copied into another store by a
    merge) or absent (a store before schema 6) is not used, and the export is still the same."""
    store = ddp["tmp"] / "kept.db"
    shutil.copy(ddp["store"], store)
    engine = open_engine(store)
    with engine.connect() as c:  # the ingest kept a row per trace (before link_kernels: stale now)
        assert c.execute(text("SELECT COUNT(*) FROM trace_links")).scalar() == 2
    assert all(refresh_links(engine, t) for t in ddp["traces"].values())
    with Session(engine) as s:
        for r, t in ddp["traces"].items():
            events = load_events(s, t)
            by_kernel, comm = stored_links(s, s.get(Trace, t), len(events), min(e.id for e in events),
                                           max(e.id for e in events))
            assert by_kernel is not None, comm
            by_kernel_all, labels = ddp["fast_links"][r]
            assert len(comm) == 70 and set(comm) == {k for k, _ in labels}
            assert sorted(by_kernel.items()) == sorted(kv for kv in by_kernel_all if kv[0] not in set(comm))
    engine.dispose()
    kept, got = _export_bytes(store, "ddp")
    assert got["ranks_links_kept"] == 2 and got["ranks_links_computed"] == 0
    assert orjson.loads(kept)["traceEvents"] == ddp["doc"]["traceEvents"]
    with open_engine(store).begin() as c:  # rank 0's kernel links change: its row is stale
        c.execute(text("DELETE FROM kernel_nodes WHERE id = (SELECT MAX(id) FROM kernel_nodes WHERE rank = 0)"))
    stale, got = _export_bytes(store, "ddp")
    assert (got["ranks_links_kept"], got["ranks_links_computed"]) == (1, 1)
    with open_engine(store).begin() as c:
        c.execute(text("DELETE FROM trace_links"))
    computed, got = _export_bytes(store, "ddp")
    assert got["ranks_links_computed"] == 2 and stale == computed and stale != kept
    # A store of schema 5 (no trace_links), opened read-only, reads as before.
    with open_engine(store).begin() as c:
        c.execute(text("DROP TABLE trace_links"))
        c.execute(text("UPDATE alembic_version SET version_num = '0005'"))
        c.execute(text("UPDATE store_meta SET value = '5' WHERE key = 'schema_version'"))
    old, got = _export_bytes(store, "ddp", read_only=True)
    assert got["ranks_links_computed"] == 2 and old == computed
    # Rows a merge copies into a store where the events' ids moved are not trusted.
    source = ddp["tmp"] / "kept_source.db"
    shutil.copy(ddp["store"], source)
    engine = open_engine(source)
    assert all(refresh_links(engine, t) for t in ddp["traces"].values())
    engine.dispose()
    target = ddp["tmp"] / "merged.db"
    shutil.copy(ddp["store"], target)
    merged = merge_store(source, open_engine(target), run_name="copy")
    assert merged["rows"]["trace_links"] == 2
    copied, got = _export_bytes(target, "copy")
    assert got["ranks_links_computed"] == 2 and got["events_with_nodes"] == sum(ddp["mapped"].values())
    with open_engine(target).begin() as c:
        c.execute(text("DELETE FROM trace_links"))
    assert copied == _export_bytes(target, "copy")[0]


def test_ranks_filter_and_bad_ranks(ddp):
    out = ddp["tmp"] / "r1.trace.json"
    res = CliRunner().invoke(main, ["export-trace", str(ddp["store"]), "--run", "ddp", "--ranks", "1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    doc = orjson.loads(out.read_bytes())
    got = validate_trace_events(doc)
    assert got["ranks"] == [1] and got["flows"] == 0
    assert got["phases"]["X"] + got["phases"]["i"] == sum(ddp["original"][1].values())
    # The same clock as the whole run's export: offsets come from the reference rank either way.
    assert doc["graphdeck"]["offsets"]["1"] == ddp["doc"]["graphdeck"]["offsets"]["1"]
    for bad, named in (("1,3-4", "3-4"), ("0,x", "'x'"), ("5-2", "'5-2'"), ("7", "7")):
        res = CliRunner().invoke(main, ["export-trace", str(ddp["store"]), "--run", "ddp", "--ranks", bad,
                                        "-o", str(ddp["tmp"] / "bad.json")])
        assert res.exit_code == 2 and named in res.output, (bad, res.output)
        assert not (ddp["tmp"] / "bad.json").exists()
    res = CliRunner().invoke(main, ["export-trace", str(ddp["store"]), "--run", "nope"])
    assert res.exit_code == 2 and "nope" in res.output
    assert parse_ranks("0-2, 5", range(8)) == [0, 1, 2, 5] and parse_ranks("all", [3, 1]) == [1, 3]
    with pytest.raises(UsageError, match="ranks with one: 0-1"):
        parse_ranks("2", [0, 1])


def test_streamed_in_bounded_chunks(ddp):
    """The writer hands over ~1 MiB pieces rank by rank, never the whole file at once."""
    engine = open_engine(ddp["store"], read_only=True)
    with Session(engine) as s:
        plan = plan_export(s, 1)
        sizes = [len(c) for c in iter_export(s, plan)]
    engine.dispose()
    assert len(sizes) > 10 and max(sizes) < CHUNK_BYTES + 1_000_000
    assert sum(sizes) == len(gzip.open(ddp["file"]).read())


def test_api_streams_the_download_and_names_bad_ranks(ddp):
    with LiveServer(ddp["store"]) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        with client.stream("GET", "/api/runs/ddp/export-trace") as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "application/gzip"
            assert 'filename="ddp.trace.json.gz"' in resp.headers["content-disposition"]
            assert "content-length" not in resp.headers  # streamed (chunked), not built whole first
            body = b"".join(resp.iter_raw())
        doc = orjson.loads(gzip.open(io.BytesIO(body)).read())
        assert doc["traceEvents"] == ddp["doc"]["traceEvents"]
        resp = client.get("/api/runs/1/export-trace", params={"ranks": "0", "gzip": "false"})
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
        assert validate_trace_events(resp.json())["ranks"] == [0]
        for bad, named in (("0,3-4", "3-4"), ("zero", "'zero'")):
            resp = client.get("/api/runs/ddp/export-trace", params={"ranks": bad})
            assert resp.status_code == 400 and named in resp.json()["error"], resp.text
        assert client.get("/api/runs/nope/export-trace").status_code == 404


def test_hta_two_rank_nccl_traces(tmp_path):
    """HTA's sampled NCCL job (ranks 0 and 1 of 128, no graphs): valid, linked, re-ingests alike."""
    files = [shared_path(*HTA, f"sampled_rank-{r}.json.gz") for r in (0, 1)]
    store = tmp_path / "hta.db"
    engine = open_engine(store)
    for f in files:
        ingest_trace(engine, f, run_name="hta")
    with Session(engine) as s:
        aligned = align_and_match(s, 1)
        traces = dict(s.execute(text("SELECT rank, id FROM traces ORDER BY rank")).all())
        for t in traces.values():  # NOTE: [Export kernel links] on traces without graphs
            m = map_trace(s, t)
            got = kernel_links(s, t, load_events(s, t))
            assert (list(got[0].items()), list(got[1].items())) == (list(m.by_kernel.items()), list(m.comm_label.items()))
    engine.dispose()
    out = tmp_path / "hta.trace.json.gz"
    res = CliRunner().invoke(main, ["export-trace", str(store), "--run", "hta", "--ranks", "0-1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    doc = orjson.loads(gzip.open(out).read())
    got = validate_trace_events(doc)
    assert got["ranks"] == [0, 1]
    assert got["flows"] == sum(1 for c in aligned["collectives"] if len(c["ranks"]) == 2) > 0
    again = tmp_path / "again.db"
    _reingest(out, again, "again")
    by_rank, orig = _events_by_rank(again, "again"), _stored_events(store, traces)
    assert sorted(by_rank) == [0, 1]
    for r in (0, 1):
        off = aligned["offsets"][r]["offset_ns"]
        assert by_rank[r] == Counter({(ph, n, ts - off, d): k for (ph, n, ts, d), k in orig[r].items()}), r


@pytest.fixture(scope="module")
def scale10(tmp_path_factory):
    """10 ranks of the scale harness (bench/scale_harness.py; seed 0: straggler 7, divergent 9,
    rank 1 without a trace; on rank 2 collectives #1 and #2 start on the same ns), 600 events a rank."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.scale_harness import make_scale_run

    store = tmp_path_factory.mktemp("scale10") / "scale10.db"
    return store, make_scale_run(str(store), 10, seed=0, traces="cpu", events_per_rank=600, workers=1)


def test_scale_run_flows_pair_skipped_rank_named_and_reingest_keeps_every_rank(scale10, tmp_path):
    store, run = scale10
    env = {"GRAPHDECK_STORE": str(store)}  # honoured like the other commands
    out = tmp_path / "sub.json.gz"
    res = CliRunner().invoke(main, ["export-trace", "--run", "scale", "--ranks", "0-9", "-o", str(out)], env=env)
    assert res.exit_code == 0, res.output
    assert f"skipped rank(s) {run.missing}: no trace ingested" in res.output
    doc = orjson.loads(gzip.open(out).read())
    got = validate_trace_events(doc)  # every flow id has its s and its f, each bound to a slice
    ranks = [r for r in range(10) if r != run.missing]
    assert got["ranks"] == ranks and doc["graphdeck"]["skipped"] == {str(run.missing): "no trace ingested"}
    assert got["phases"]["s"] == got["phases"]["f"] == got["flows"] > 0
    # every matched collective linked between the last rank and every other (none lost to same-ns
    # starts), but for the divergent rank's collective #diverge_seq: another element count there,
    # so not one collective with the others (neither a flow nor a clock offset from it)
    assert doc["graphdeck"]["collectives_diverging_not_linked"] == 1
    assert got["flows"] == (len(ranks) - 1) * doc["graphdeck"]["collectives_linked"] - 1
    other = next(r for r in ranks if r not in (run.divergent, min(ranks)))
    assert doc["graphdeck"]["offsets"][str(run.divergent)]["matched"] == doc["graphdeck"]["offsets"][str(other)]["matched"]
    res = CliRunner().invoke(main, ["export-trace", "--run", "scale", "--ranks", "0,1", "-o", str(tmp_path / "a.json")],
                             env=env)  # a list naming the traceless rank: the same as "all"
    assert res.exit_code == 0 and f"skipped rank(s) {run.missing}: no trace ingested" in res.output, res.output
    res = CliRunner().invoke(main, ["export-trace", "--run", "scale", "--ranks", str(run.missing), "-o",
                                    str(tmp_path / "b.json")], env=env)
    assert res.exit_code == 2 and "none of the asked ranks" in res.output, res.output
    assert not (tmp_path / "b.json").exists()
    again = tmp_path / "re.db"
    assert f"a graphdeck export of {len(ranks)} ranks" in _reingest(out, again, "reimport")
    by_rank = _events_by_rank(again, "reimport")
    per_pid = Counter(ev["pid"] for ev in doc["traceEvents"] if ev["ph"] in ("X", "i"))
    assert sorted(by_rank) == ranks
    assert {r: sum(c.values()) for r, c in by_rank.items()} == {r: per_pid[r] for r in ranks}
    engine = open_engine(again, read_only=True)
    with Session(engine) as s:
        aligned = align_and_match(s, 1)
    engine.dispose()
    assert sorted(aligned["offsets"]) == ranks  # check-ranks / summary see every exported rank
    assert all(abs(o["offset_ns"]) < 1000 for o in aligned["offsets"].values())  # aligned already
    # Traces only, no compile/collective records: the ranks check says it compared the traces'
    # collectives (finding the divergent rank) and is INCOMPLETE for the records it could not see.
    res = CliRunner().invoke(main, ["check-ranks", str(again), "--run", "reimport"])
    assert res.exit_code == 3 and "agree" not in res.output, res.output
    assert "the traces' collectives only compared" in res.output and f"rank(s) [{run.divergent}] diverge" in res.output
    assert "compile sequences and the recorded collective schedules were not compared" in res.output, res.output
    res = CliRunner().invoke(main, ["summary", "reimport", "--store", str(again), "--json"])
    ranks_check = next(c for c in orjson.loads(res.stdout)["checks"] if c["key"] == "ranks")
    assert ranks_check["verdict"] == "INCOMPLETE" and "agree" not in ranks_check["headline"], ranks_check


def test_postgresql_store_exports_the_same_events(tmp_path, pg_url):
    """The export reads rows through the driver's cursor (NOTE: [Trace export]): a PostgreSQL store
    of HTA's two ranks gives the same events as a SQLite one."""
    files = [shared_path(*HTA, f"sampled_rank-{r}.json.gz") for r in (0, 1)]
    docs = []
    for url in (str(tmp_path / "hta.db"), pg_url):
        engine = open_engine(url)
        for f in files:
            ingest_trace(engine, f, run_name="hta")
        buf = io.BytesIO()
        with Session(engine) as s:
            got = export_trace(s, s.execute(text("SELECT id FROM runs WHERE name = 'hta'")).scalar(), buf)
        engine.dispose()
        assert got["ranks_links_kept"] == 2, got  # kept at ingest on both (NOTE: [Stored kernel links])
        docs.append(orjson.loads(buf.getvalue()))
    assert docs[0]["traceEvents"] == docs[1]["traceEvents"] and len(docs[0]["traceEvents"]) > 1000


@pytest.mark.browser
def test_download_button_on_the_run_timeline(ddp, browser, tmp_path):
    """The run timeline's "Download for Perfetto" link, ranks typed in, downloads that export."""
    with LiveServer(ddp["store"]) as srv:
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.goto(f"{srv.url}/#/runs/ddp/timeline")
        link = page.locator("#export-trace")
        link.wait_for()
        assert link.get_attribute("href") == "/api/runs/ddp/export-trace"
        page.fill("#export-ranks", "1")
        assert link.get_attribute("href") == "/api/runs/ddp/export-trace?ranks=1"
        with page.expect_download() as got:
            link.click()
        path = tmp_path / "dl.json.gz"
        got.value.save_as(path)
        assert got.value.suggested_filename == "ddp.trace.json.gz"
        page.close()
    doc = orjson.loads(gzip.open(path).read())
    assert validate_trace_events(doc)["ranks"] == [1]
