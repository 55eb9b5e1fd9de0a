"""Kineto trace ingest on real traces from ../shared/data/traces (see its SOURCES.md).

Counts are checked against an independent count: the test ``json.load``s the same file and counts
the events itself. Malformed inputs are made in ``tmp_path`` by cutting real files.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import zlib
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.collectives import INDEX_VERSION
from graphdeck.errors import BadInputError, TruncatedInputError
from graphdeck.store.db import open_engine
from graphdeck.store.schema import InternedString, Rank, Run, Trace, TraceEvent
from graphdeck.store.traces import ingest_trace
from tests.conftest import shared_path

SAMPLED_RANK0 = "hta/trace_filter/sampled_rank-0.json.gz"
CPU_ONLY = "hta/cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
LEGACY_SMALL = "kineto/tb_plugin_test_gpu_metrics_input.json"
LEGACY_SAMPLE = "kineto/tb_plugin_samples/resnet50_profiler_api_num_workers_4.worker0.pt.trace.json.gz"
NO_DIST_INFO = "hta/distributed_info_unavailable/distributed_info_not_found.json.gz"
NO_RANK = "hta/rank_unavailable/rank_not_found.json.gz"
LARGE_INT = "hta/large_integer_trace/rank-70.Mar_25_20_48_12.2861.pt.trace.json.gz"
AMD = "hta/amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz"
PLAIN_JSON = "kineto/docs_before_fix_trace.json"
FLOW_V1 = "perfetto/flow_events_json_v1.json"
FLOW_V2 = "perfetto/flow_events_json_v2.json"
ET_FILE = "hta/execution_trace/benchmark_simple_add_et.json.gz"
MEMORY_TIMELINE = "hta/memory_analysis/memory_timeline.raw.gz"


def trace_file(rel: str) -> Path:
    """A corpus file; skipped when ../shared is absent, except under CI=true where it must exist."""
    return shared_path("data", "traces", rel)


def load(path: Path) -> dict:
    """The whole file, decoded independently of the code under test (decimals exact)."""
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return json.loads(data, parse_float=Decimal)


def stored_kind(events: list) -> list[dict]:
    """The events the ingest must store: dicts with ph X/i/I, or the s/f ends of a forward→backward
    flow (``cat: fwdbwd``, NOTE: [Forward-backward flows]), and a numeric ts."""
    return [e for e in events if isinstance(e, dict) and (e.get("ph") in ("X", "i", "I") or (
            e.get("ph") in ("s", "f") and e.get("cat") == "fwdbwd"))
            and isinstance(e.get("ts"), (int, Decimal)) and not isinstance(e.get("ts"), bool)]


@pytest.fixture
def engine(tmp_path):
    return open_engine(tmp_path / "store.db")


def counts(engine) -> tuple[int, int]:
    with Session(engine) as s:
        return s.scalar(select(func.count()).select_from(Trace)), s.scalar(select(func.count()).select_from(TraceEvent))


def trace_row(engine, trace_id: int) -> Trace:
    with Session(engine) as s:
        return s.get(Trace, trace_id)


def event_rows(engine, trace_id: int) -> list[tuple]:
    with Session(engine) as s:
        stmt = (select(TraceEvent.ph, InternedString.value, TraceEvent.ts_ns, TraceEvent.dur_ns, TraceEvent.pid,
                       TraceEvent.tid, TraceEvent.correlation, TraceEvent.args_json)
                .join(InternedString, InternedString.id == TraceEvent.name_id)
                .where(TraceEvent.trace_id == trace_id).order_by(TraceEvent.id))
        return list(s.execute(stmt))


def test_hta_sampled_rank0_counts_rank_and_meta(engine):
    path = trace_file(SAMPLED_RANK0)
    doc = load(path)
    expected = stored_kind(doc["traceEvents"])
    r = ingest_trace(engine, path, run_name="job", strict=True)
    assert r.status == "ok"
    assert r.num_events == len(expected) == 4811, (
        f"stored {r.num_events} events == number of X/i/I events in the file ({len(expected)}), "
        "counted independently with json.load")
    assert r.stats["events_total"] == len(doc["traceEvents"]), "events_total counts every traceEvents item"
    assert r.stats["by_ph"] == dict(Counter(e["ph"] for e in doc["traceEvents"])), "by_ph counts phases as in the file"
    assert r.stats["skipped_bad_event"] == 0 and r.stats["truncated"] == 0
    assert (r.rank, r.stats["rank_source"]) == (0, "distributedInfo"), "rank 0 from distributedInfo"
    assert counts(engine) == (1, len(expected)), "one trace row and one row per stored event"
    t = trace_row(engine, r.trace_id)
    meta = json.loads(t.meta_json)
    assert meta["distributedInfo"]["world_size"] == 128, "distributedInfo kept in meta_json"
    assert meta["ts_clock"] == "trace", "no baseTimeNanoseconds: ts_ns is on the trace's own clock"
    kept = json.loads(t.stats_json)
    index = kept.pop("collective_index")  # NOTE: [Collective index]: kept beside the ingest's counters
    assert t.num_events == r.num_events and kept == r.stats
    assert index["v"] == INDEX_VERSION and len(index["collectives"]) > 0 and index["steps"]
    with Session(engine) as s:
        run = s.get(Run, r.run_id)
        assert (run.name, run.world_size) == ("job", 128), "the run takes the trace's world size"
        ranks = s.scalars(select(Rank).where(Rank.run_id == r.run_id)).all()
        assert [(x.rank, x.world_size) for x in ranks] == [(0, 128)], "a Rank row for rank 0 of 128"
    first = min(expected, key=lambda e: e["ts"])
    assert t.start_ns == round(first["ts"] * 1000), "start_ns is the earliest ts in ns"
    assert t.end_ns == max(round(e["ts"] * 1000) + round(e.get("dur", 0) * 1000) for e in expected)


def test_cpu_only_trace_meta_after_events_and_epoch_base(engine):
    path = trace_file(CPU_ONLY)
    doc = load(path)
    keys = list(doc)
    assert keys.index("baseTimeNanoseconds") > keys.index("traceEvents"), "this file has its base after the events"
    expected = stored_kind(doc["traceEvents"])
    r = ingest_trace(engine, path, run_name="cpu", strict=True)
    assert r.num_events == len(expected) == 18, "16 X + 2 i events stored; 12 M events only counted"
    assert r.stats["by_ph"] == {"M": 12, "X": 16, "i": 2}
    assert r.rank == 34 and r.stats["rank_source"] == "distributedInfo"
    meta = json.loads(trace_row(engine, r.trace_id).meta_json)
    for key in ("INFO", "traceName", "displayTimeUnit", "baseTimeNanoseconds"):
        assert key in meta, f"top-level key {key!r} written after traceEvents is kept in meta_json"
    assert (meta["ts_clock"], meta["ts_base_applied"]) == ("unix_epoch", "peek"), "read from the file's end first"
    assert meta["process_labels"], "process labels from M events are kept"
    base = doc["baseTimeNanoseconds"]
    rows = event_rows(engine, r.trace_id)
    want = [base + round(e["ts"] * 1000) for e in expected]
    assert [row.ts_ns for row in rows] == want, "ts_ns = baseTimeNanoseconds + round(ts µs * 1000)"

    class Unseekable(io.RawIOBase):  # an upload stream: the base can only be applied after the fact
        def __init__(self, data):
            self.src = io.BytesIO(data)

        def readable(self):
            return True

        def readinto(self, b):
            chunk = self.src.read(len(b))
            b[: len(chunk)] = chunk
            return len(chunk)

    r2 = ingest_trace(engine, io.BufferedReader(Unseekable(path.read_bytes())), run_name="cpu2", strict=True)
    meta2 = json.loads(trace_row(engine, r2.trace_id).meta_json)
    assert (meta2["ts_clock"], meta2["ts_base_applied"]) == ("unix_epoch", "update")
    assert [row.ts_ns for row in event_rows(engine, r2.trace_id)] == want, "the same times, applied after the fact"


def test_decimal_microseconds_are_exact_with_base_before_events(engine):
    path = trace_file(AMD)
    doc = load(path)
    expected = stored_kind(doc["traceEvents"])
    r = ingest_trace(engine, path, run_name="amd", strict=True)
    rows = event_rows(engine, r.trace_id)
    assert len(rows) == len(expected) == 123  # 115 X/i + 8 fwdbwd flow ends
    base = doc["baseTimeNanoseconds"]
    assert [row.ts_ns for row in rows] == [base + round(e["ts"] * 1000) for e in expected], \
        "decimal µs such as 4203669604595.407 become exact ns (no float rounding)"
    assert [row.dur_ns for row in rows] == [round(e.get("dur", 0) * 1000) for e in expected]
    assert r.stats["rank_source"] == "default", "no distributedInfo, no rank argument, no rank in the name"


def test_legacy_2021_trace_string_tids_and_external_id(engine):
    path = trace_file(LEGACY_SMALL)
    doc = load(path)
    expected = stored_kind(doc["traceEvents"])
    r = ingest_trace(engine, path, run_name="legacy", strict=True)
    assert r.num_events == len(expected) == 256
    rows = event_rows(engine, r.trace_id)
    tids = {row.tid for row in rows}
    assert any(t.startswith("stream ") for t in tids), f"string tids like 'stream 7' kept as strings: {sorted(tids)[:5]}"
    want_corr = [e.get("args", {}).get("correlation", e.get("args", {}).get("External id")) for e in expected]
    assert [row.correlation for row in rows] == want_corr, "correlation from args.correlation, else 'External id'"


def test_legacy_tb_plugin_sample(engine):
    path = trace_file(LEGACY_SAMPLE)
    doc = load(path)
    expected = stored_kind(doc["traceEvents"])
    r = ingest_trace(engine, path, run_name="legacy", batch_size=20_000)
    assert r.num_events == len(expected) == 48894, "every X/i event of the 2021 tb_plugin sample is stored"
    assert r.stats["by_ph"]["s"] == 9048 and r.stats["by_ph"]["f"] == 9819, "flow events counted, not stored"
    with Session(engine) as s:
        n_stream = s.scalar(select(func.count()).select_from(TraceEvent)
                            .where(TraceEvent.trace_id == r.trace_id, TraceEvent.tid.like("stream %")))
    assert n_stream == sum(1 for e in expected if str(e.get("tid")).startswith("stream ")) > 0


def test_rank_without_distributed_info(engine, tmp_path):
    path = trace_file(NO_DIST_INFO)
    r = ingest_trace(engine, path, run_name="r", rank=5)
    assert (r.rank, r.stats["rank_source"]) == (5, "argument"), "no distributedInfo: the rank argument"
    assert r.num_events == 2467
    r = ingest_trace(engine, path, run_name="r2")  # the same bytes again in "r" would be refused (a duplicate)
    assert (r.rank, r.stats["rank_source"]) == (0, "default"), "no argument, no rank in the name: rank 0"
    renamed = tmp_path / "job_rank_3.trace.json.gz"
    shutil.copy(path, renamed)
    r = ingest_trace(engine, renamed, run_name="r3")
    assert (r.rank, r.stats["rank_source"]) == (3, "filename"), "rank parsed from 'rank_3' in the file name"
    with open(path, "rb") as fh:
        r = ingest_trace(engine, fh, run_name="r4", name="upload-rank7.json.gz")
    assert (r.rank, r.stats["rank_source"]) == (7, "filename"), "a file object: rank from the name argument"
    r = ingest_trace(engine, trace_file(NO_RANK), run_name="r", rank=2)
    assert (r.rank, r.stats["rank_source"]) == (2, "argument"), "distributedInfo without a rank: the argument"


def test_large_integer_kept_as_string(engine):
    path = trace_file(LARGE_INT)
    r = ingest_trace(engine, path, run_name="big", strict=True)
    assert r.num_events == 2 and r.stats["big_int_as_string"] == 1, "the one 'Comms Id' > int64 max is counted"
    assert r.rank == 70 and r.stats["rank_source"] == "filename"
    args = json.loads(event_rows(engine, r.trace_id)[1].args_json)
    assert args["Comms Id"] == "10159970886766084423", "an integer beyond int64 is stored as its decimal string"


def test_perfetto_flow_files(engine):
    v1 = ingest_trace(engine, trace_file(FLOW_V1), run_name="flow", strict=True)
    assert v1.num_events == 5 and v1.stats["by_ph"] == {"X": 5, "s": 2, "t": 1, "f": 2}, \
        "v1 flows (s/t/f) are counted, only the 5 X slices stored"
    v2 = ingest_trace(engine, trace_file(FLOW_V2), run_name="flow", strict=True)
    assert v2.num_events == 6 and v2.stats["by_ph"] == {"B": 1, "E": 1, "X": 5, "i": 1}, \
        "v2 flows live on X events (bind_id): 5 X + 1 i stored, B/E counted"
    assert trace_row(engine, v2.trace_id).meta_json and counts(engine) == (2, 11)


def test_ingest_twice_interns_each_name_once(engine):
    path = trace_file(SAMPLED_RANK0)
    ingest_trace(engine, path, run_name="a", batch_size=700)
    with Session(engine) as s:
        n_strings = s.scalar(select(func.count()).select_from(InternedString))
    r = ingest_trace(engine, path, run_name="b", batch_size=5000)
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(InternedString)) == n_strings, \
            "the second ingest of the same file adds no string"
    assert counts(engine) == (2, 2 * 4811), "batches of 700 and of 5000 store the same events"
    assert r.num_events == 4811


# ---------------------------------------------------------------------------- malformed input


def cut_gzip(src: Path, dst: Path, fraction: float) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: int(len(data) * fraction)])
    return dst


def test_truncated_gzip_keeps_events_before_the_cut(engine, tmp_path):
    src = trace_file(SAMPLED_RANK0)
    full = [(e["ph"], e["name"], round(e["ts"] * 1000)) for e in stored_kind(load(src)["traceEvents"])]
    cut = cut_gzip(src, tmp_path / "sampled_rank-0.json.gz", 0.5)
    with pytest.raises(TruncatedInputError) as err:
        ingest_trace(engine, cut, run_name="cut", batch_size=1000)
    e = err.value
    assert "truncated after" in e.message and "byte offset" in e.message, e.message
    assert e.details["kept"] is True and e.details["stats"]["truncated"] == 1
    t = trace_row(engine, e.details["trace_id"])
    rows = event_rows(engine, t.id)
    assert t.status == "truncated", "the trace says it is truncated"
    assert t.num_events == len(rows) == e.details["num_events"], "num_events equals the rows kept"
    assert 0 < len(rows) < len(full), f"half a file keeps some but not all events ({len(rows)} of {len(full)})"
    assert [(r.ph, r.value, r.ts_ns) for r in rows] == full[: len(rows)], "the kept events are the file's first N, in order"
    recoverable = zlib.decompressobj(wbits=31).decompress(cut.read_bytes())
    assert e.details["stats"]["bytes_json"] == len(recoverable), \
        "the parser saw every byte zlib can recover from the cut file, counted independently"
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(Trace).where(Trace.status == "ingesting")) == 0


def test_truncated_gzip_strict_keeps_nothing(engine, tmp_path):
    cut = cut_gzip(trace_file(SAMPLED_RANK0), tmp_path / "sampled_rank-0.json.gz", 0.5)
    with pytest.raises(TruncatedInputError) as err:
        ingest_trace(engine, cut, run_name="cut", strict=True, batch_size=1000)
    assert err.value.details["kept"] is False and "truncated" in err.value.message
    assert counts(engine) == (0, 0), "strict: no trace row and no event kept, even from committed batches"


def test_truncated_plain_json_mid_array(engine, tmp_path):
    src = trace_file(PLAIN_JSON)
    doc = load(src)
    events = doc["traceEvents"]
    # Rewrite the real events one per line, then cut inside event k: exactly events[:k] are whole.
    k = 40
    lines = [json.dumps(e, default=str) for e in events]
    text = '{"schemaVersion": 1, "traceEvents": [\n' + ",\n".join(lines) + "\n]}"
    cut_at = text.index(lines[k]) + len(lines[k]) // 2
    path = tmp_path / "cut.json"
    path.write_text(text[:cut_at])
    with pytest.raises(TruncatedInputError) as err:
        ingest_trace(engine, path, run_name="cut")
    expected = len(stored_kind(events[:k]))
    assert err.value.details["num_events"] == expected, \
        f"the {expected} X/i events among the {k} whole events before the cut are kept"
    assert err.value.details["stats"]["events_total"] == k
    # and a raw byte cut of the real file
    raw = src.read_bytes()
    path2 = tmp_path / "raw_cut.json"
    path2.write_bytes(raw[: int(len(raw) * 0.8)])
    with pytest.raises(TruncatedInputError) as err2:
        ingest_trace(engine, path2, run_name="cut")
    t = trace_row(engine, err2.value.details["trace_id"])
    assert t.status == "truncated" and t.num_events == len(event_rows(engine, t.id)) > 0


def test_not_json_and_not_a_trace(engine, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("this is not a trace, just some text\n")
    with pytest.raises(BadInputError, match="not valid JSON"):
        ingest_trace(engine, bad, run_name="x")
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    with pytest.raises(BadInputError, match="empty"):
        ingest_trace(engine, empty, run_name="x")
    fake_gz = tmp_path / "fake.json.gz"
    fake_gz.write_bytes(b"\x1f\x8b" + b"not really gzip" * 10)
    with pytest.raises(BadInputError, match="gzip"):
        ingest_trace(engine, fake_gz, run_name="x")
    with pytest.raises(BadInputError, match="execution trace"):
        ingest_trace(engine, trace_file(ET_FILE), run_name="x")
    with pytest.raises(BadInputError, match="none of the"):
        ingest_trace(engine, trace_file(MEMORY_TIMELINE), run_name="x")
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(Run)) == 0, "a rejected file creates no run"
    assert counts(engine) == (0, 0)


def test_bad_events_skipped_and_counted_or_strict_fails(engine, tmp_path):
    events = [
        {"ph": "X", "name": "ok", "ts": 1, "dur": 2, "pid": 1, "tid": 1},
        {"ph": "X", "name": "no ts", "dur": 2, "pid": 1, "tid": 1},
        {"ph": "X", "name": "string ts", "ts": "soon", "pid": 1, "tid": 1},
        {"ph": "i", "name": "bad dur ignored for i", "ts": 3, "pid": 1, "tid": 1},
        {"ph": "X", "name": "bad dur", "ts": 4, "dur": [1], "pid": 1, "tid": 1},
        "not an event",
        {"name": "no ph", "ts": 5},
    ]
    path = tmp_path / "bad_events.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = ingest_trace(engine, path, run_name="bad")
    s = r.stats
    assert r.num_events == 2, "only the good X and i are stored"
    assert (s["skipped_missing_ts"], s["skipped_bad_ts"], s["skipped_bad_dur"], s["skipped_not_object"],
            s["skipped_missing_ph"]) == (1, 1, 1, 1, 1)
    assert s["skipped_bad_event"] == 5 and s["events_total"] == 7
    with pytest.raises(BadInputError, match="strict"):
        ingest_trace(engine, path, run_name="bad-strict", strict=True)
    assert counts(engine) == (1, 2), "strict failure keeps nothing of its own"


class FailingReader(io.RawIOBase):
    """A source that dies after ``limit`` bytes (a disk or network error mid-ingest)."""

    def __init__(self, data: bytes, limit: int):
        self.buf, self.limit, self.pos = data, limit, 0

    def readable(self):
        return True

    def read(self, n=-1):
        if self.pos >= self.limit:
            raise RuntimeError("simulated read failure")
        n = len(self.buf) if n is None or n < 0 else n
        out = self.buf[self.pos : min(self.pos + n, self.limit)]
        self.pos += len(out)
        return out


def test_unexpected_error_deletes_the_partial_trace(engine):
    data = trace_file(SAMPLED_RANK0).read_bytes()
    with pytest.raises(RuntimeError, match="simulated"):
        ingest_trace(engine, FailingReader(data, len(data) // 2), run_name="boom", batch_size=500)
    assert counts(engine) == (0, 0), "batches committed before the failure are deleted with the trace row"


# ---------------------------------------------------------------------------- the chunked orjson reading

WIDE_CLOCK = "tracelens/inference/vllm_decode_full/graph_execution.json.gz"  # ts ~6.5e12 µs, past 2**42


def exact_reading(monkeypatch):
    """Switch the chunked orjson reading off (the seam: ``traces.chunked_events``), so the ingest
    reads with ijson's exact decimals, as it did before the chunked reading existed."""
    import graphdeck.store.traces as traces

    def gives_up(reader, st):
        raise traces.NotFast("switched off by the test")
        yield  # pragma: no cover

    monkeypatch.setattr(traces, "chunked_events", gives_up)


def reading_used(monkeypatch) -> list[str]:
    """Record whether the chunked reading ran to the end ("done") or gave up."""
    import graphdeck.store.traces as traces

    seen, real = [], traces.chunked_events

    def spy(reader, st):
        seen.append("start")
        yield from real(reader, st)
        seen.append("done")

    monkeypatch.setattr(traces, "chunked_events", spy)
    return seen


def full_rows(engine, trace_id: int) -> tuple:
    t = trace_row(engine, trace_id)
    meta = {k: v for k, v in json.loads(t.meta_json).items()}
    return event_rows(engine, trace_id), (t.status, t.num_events, t.start_ns, t.end_ns, meta, json.loads(t.stats_json))


@pytest.mark.parametrize("rel", [WIDE_CLOCK, AMD, LARGE_INT, CPU_ONLY, FLOW_V2, LEGACY_SMALL])
def test_chunked_reading_stores_what_the_exact_reading_stores(rel, tmp_path, monkeypatch):
    """orjson reads numbers as floats, not decimals: the rows must still be the exact reading's,
    including Kineto clocks past 2**42 µs (vLLM, ts ~6.5e12), where a float has under 1 ns of
    resolution left and the ns come from the 3-decimal text (NOTE: [Chunked orjson reading])."""
    path = trace_file(rel)
    fast_engine, exact_engine = open_engine(tmp_path / "fast.db"), open_engine(tmp_path / "exact.db")
    with monkeypatch.context() as m:
        seen = reading_used(m)
        fast = ingest_trace(fast_engine, path, run_name="r", strict=True)
    assert seen == ["start", "done"], f"the chunked reading read {rel} to the end"
    with monkeypatch.context() as m:
        exact_reading(m)
        exact = ingest_trace(exact_engine, path, run_name="r", strict=True)
    assert full_rows(fast_engine, fast.trace_id) == full_rows(exact_engine, exact.trace_id), \
        "same rows, trace times, meta and stats as the exact reading"
    doc = load(path)
    expected = stored_kind(doc["traceEvents"])
    base = int(doc.get("baseTimeNanoseconds", 0)) if rel != LEGACY_SMALL else 0
    rows = event_rows(fast_engine, fast.trace_id)
    assert [r.ts_ns for r in rows] == [base + round(e["ts"] * 1000) for e in expected], \
        "ts_ns from json.load's exact Decimal, independently"


def test_chunk_cuts_inside_strings_and_nested_objects_are_not_taken(engine, tmp_path, monkeypatch):
    """A cut between events is proved by parsing; ``}, {`` inside a name or between nested args
    objects must not pass for one. Made from the AMD trace: names and args edited to hold those
    patterns, read in 1 KiB chunks (many cuts), compared with the exact reading."""
    import graphdeck.store.trace_fast as trace_fast

    raw = trace_file(AMD).read_bytes()
    doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)  # floats: written back as read
    for i, e in enumerate(doc["traceEvents"]):
        if e.get("ph") == "X" and i % 3 == 0:
            e["name"] = e["name"] + '}, {"ph": "X", "ts": 1},'
            e.setdefault("args", {})["nested"] = [{"a": {"b": 1}}, {"c": "}, {"}]
    path = tmp_path / "tricky.json"
    path.write_text(json.dumps(doc, indent=1))
    monkeypatch.setattr(trace_fast, "CHUNK_BYTES", 1024)
    with monkeypatch.context() as m:
        seen = reading_used(m)
        fast = ingest_trace(engine, path, run_name="fast", strict=True)
    assert seen == ["start", "done"]
    with monkeypatch.context() as m:
        exact_reading(m)
        exact = ingest_trace(engine, path, run_name="exact", strict=True)
    assert event_rows(engine, fast.trace_id) == event_rows(engine, exact.trace_id)
    assert fast.num_events == len(stored_kind(load(path)["traceEvents"])) == 123
    assert any('}, {"ph"' in r.value for r in event_rows(engine, fast.trace_id)), "the edited names are kept whole"


def test_trailing_comma_and_more_decimals_fall_back_to_the_exact_reading(engine, tmp_path, monkeypatch):
    """What the chunked reading cannot prove it leaves to the exact readers: a trailing comma
    (not JSON: the token path reports it) and a ts with 4 decimals past 2**42 µs."""
    ok = {"ph": "X", "name": "a", "ts": 6520618853487.683, "dur": 1.5, "pid": 1, "tid": 1}
    cut = tmp_path / "comma.json"
    cut.write_text('{"traceEvents": [' + json.dumps(ok) + ", " + json.dumps(ok) + ", ]}")
    with pytest.raises(TruncatedInputError):
        ingest_trace(engine, cut, run_name="comma", strict=True)
    four = tmp_path / "four.json"
    four.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 6520618853487.6835, "dur": 1, "pid": 1, "tid": 1}]}')
    seen = reading_used(monkeypatch)
    r = ingest_trace(engine, four, run_name="four", strict=True)
    assert seen == ["start"], "the chunked reading gave up on the 4-decimal ts"
    assert [row.ts_ns for row in event_rows(engine, r.trace_id)] == [round(Decimal("6520618853487.6835") * 1000)]
    huge = tmp_path / "huge.json"  # orjson reads an integer past 2**64 as a float: the exact readers keep its digits
    huge.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1, "pid": 1, "tid": 1, '
                    '"args": {"big": 123456789012345678901234567890, "n": [-99999999999999999999]}}]}')
    seen.clear()
    r = ingest_trace(engine, huge, run_name="huge", strict=True)
    assert seen == ["start"], "the chunked reading gave up on the integer it cannot keep"
    args = json.loads(event_rows(engine, r.trace_id)[0].args_json)
    assert args == {"big": "123456789012345678901234567890", "n": [-99999999999999999999]}, \
        "top-level integers past int64 as text, nested ones as numbers: what the exact reading stores"


def test_ingest_on_sqlite_and_postgres(store_url):
    """The one ingest on both store backends (SQLite: the driver's executemany with foreign-key
    checks off per batch; PostgreSQL: COPY): same rows, interned strings shared by a second
    trace, and a failed ingest deletes its partial trace on both."""
    path = trace_file(SAMPLED_RANK0)
    engine = open_engine(store_url)
    try:
        doc = load(path)
        expected = stored_kind(doc["traceEvents"])
        first = ingest_trace(engine, path, run_name="a", strict=True, batch_size=1000)
        second = ingest_trace(engine, path, run_name="b", strict=True, batch_size=1000)
        rows = event_rows(engine, first.trace_id)
        assert first.num_events == len(rows) == len(expected) == 4811
        assert [(r.ph, r.value, r.ts_ns, r.dur_ns) for r in rows] == [
            (e["ph"], e["name"], round(e["ts"] * 1000), round(e.get("dur", 0) * 1000)) for e in expected]
        assert rows == event_rows(engine, second.trace_id), "the second trace reuses the interned strings"
        with Session(engine) as s:
            n_strings = s.scalar(select(func.count()).select_from(InternedString))
        names = {e["name"] for e in expected} | {e["cat"] for e in expected if "cat" in e}
        assert n_strings == len(names), "each name and category interned once across both traces"
        data = path.read_bytes()
        with pytest.raises(RuntimeError, match="simulated"):
            ingest_trace(engine, FailingReader(data, len(data) // 2), run_name="boom", batch_size=500)
        assert counts(engine) == (2, 2 * len(expected)), "the failed ingest left nothing behind"
    finally:
        engine.dispose()
