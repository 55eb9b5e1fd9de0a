"""The trace cases with known answers (../shared/cases/traces.md, T1–T11), each on a real file
from ../shared/data/traces or an input made from one by a small edit (described per test).

Every figure the tests compare against is computed here from the file itself (``json.load``),
independently of the code under test.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import zlib
from decimal import Decimal

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from graphdeck.analysis.traces.analyze import CommRule, TraceData, hotspots, overlap
from graphdeck.analysis.traces.collectives import process_groups
from graphdeck.errors import BadInputError, TruncatedInputError
from graphdeck.server.render.timeline import timeline_figure
from graphdeck.store.db import open_engine
from graphdeck.store.schema import InternedString, Trace, TraceEvent
from graphdeck.store.traces import ingest_trace
from tests.conftest import shared_path

SAMPLED = ("hta", "trace_filter", "sampled_rank-0.json.gz")
NCCL = ("hta", "nccl_parser_config", "nccl_data.json.gz")


def corpus(*parts: str):
    return shared_path("data", "traces", *parts)


def raw_json(path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


@pytest.fixture
def engine(tmp_path):
    return open_engine(tmp_path / "s.db")


def names(engine, trace_id: int) -> list[str]:
    with Session(engine) as s:
        return list(s.scalars(select(InternedString.value).join(TraceEvent, TraceEvent.name_id == InternedString.id)
                              .where(TraceEvent.trace_id == trace_id)))


def complete_items_before_cut(text: bytes) -> list:
    """The items of traceEvents that are whole in a cut JSON text (independent of ijson)."""
    s = text.decode("utf-8", "replace")
    i = s.index("[", s.index('"traceEvents"')) + 1
    dec = json.JSONDecoder(parse_float=Decimal)
    out = []
    while True:
        while i < len(s) and s[i] in " \r\n\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(s, i)
        except ValueError:
            return out
        out.append(obj)


def test_t1_truncated_gzip_keeps_every_complete_event_before_the_cut(engine, tmp_path):
    """Made by: the first half of the bytes of sampled_rank-0.json.gz."""
    data = corpus(*SAMPLED).read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(data[: len(data) // 2])
    partial = zlib.decompressobj(wbits=31).decompress(data[: len(data) // 2])
    want = [e for e in complete_items_before_cut(partial) if e.get("ph") in ("X", "i", "I")]
    with pytest.raises(TruncatedInputError) as info:
        ingest_trace(engine, cut, run_name="t1")
    err = info.value
    assert "truncated" in err.message and "byte offset" in err.message, err.message
    assert err.details["kept"] and err.details["num_events"] == len(want), (
        f"every complete stored-kind event before the cut is kept: {err.details['num_events']} vs {len(want)}")
    with Session(engine) as s:
        trace = s.get(Trace, err.details["trace_id"])
        assert trace.status == "truncated" and trace.num_events == len(want)
        assert json.loads(trace.stats_json)["truncated"] == 1


def test_t1b_bad_token_between_events_is_skipped_and_counted_not_a_cut(engine, tmp_path):
    """A bad token in the middle of traceEvents is corrupt, not a cut: the input is
    hta/trace_filter/sampled_rank-0.json.gz decompressed, with ``oops,`` inserted right after the
    comma that follows the middle item of traceEvents (item boundaries found with
    ``json.JSONDecoder.raw_decode``). Every event of the original is stored, the stretch is
    counted (``corrupt_items`` 1), the status is "ok"; ``strict`` refuses the file as corrupt."""
    raw = raw_json(corpus(*SAMPLED))
    text = raw.decode("utf-8")
    i = text.index("[", text.index('"traceEvents"')) + 1
    dec = json.JSONDecoder()
    ends = []
    while True:
        while text[i] in " \r\n\t":
            i += 1
        if text[i] == "]":
            break
        _, i = dec.raw_decode(text, i)
        ends.append(i)
        while text[i] in " \r\n\t":
            i += 1
        if text[i] == ",":
            i += 1
    cut_at = text.index(",", ends[len(ends) // 2]) + 1
    assert cut_at > 64 * 1024, "the bad token sits past the first read"
    bad = tmp_path / "oops.json"
    bad.write_bytes((text[:cut_at] + " oops," + text[cut_at:]).encode("utf-8"))
    good = ingest_trace(engine, corpus(*SAMPLED), run_name="good")
    r = ingest_trace(engine, bad, run_name="oops")
    assert r.status == "ok" and r.num_events == good.num_events, (r.status, r.num_events, good.num_events)
    assert r.stats["events_total"] == len(ends) == good.stats["events_total"]
    assert r.stats["corrupt_items"] == 1 and r.stats["corrupt"] == 1 and r.stats["truncated"] == 0
    assert sorted(names(engine, r.trace_id)) == sorted(names(engine, good.trace_id))
    with pytest.raises(BadInputError) as info:
        ingest_trace(engine, bad, run_name="strict", strict=True)
    assert "corrupt" in info.value.message and "truncated" not in info.value.message, info.value.message
    with Session(engine) as s:
        assert s.scalar(select(Trace).where(Trace.name == "oops.json", Trace.status != "ok")) is None


def _sampled_with(old: bytes, new: bytes) -> bytes:
    raw = raw_json(corpus(*SAMPLED))
    assert raw.count(old) >= 1, old
    return raw.replace(old, new, 1)


def _first_name(raw: bytes, prefix: bytes) -> bytes:
    i = raw.index(b'"name": "' + prefix) + len(b'"name": "')
    return raw[i : raw.index(b'"', i)]


def test_t2_bare_quote_in_a_name_is_repaired_and_counted(engine):
    """Made by: one ``aten::`` name of sampled_rank-0 given a bare ``"`` in its middle."""
    raw = raw_json(corpus(*SAMPLED))
    name = _first_name(raw, b"aten::")
    bad = raw.replace(b'"name": "' + name + b'"', b'"name": "' + name[:4] + b'"' + name[4:] + b'"', 1)
    result = ingest_trace(engine, io.BytesIO(bad), run_name="t2")
    good = ingest_trace(engine, io.BytesIO(raw), run_name="t2ok")
    assert result.num_events == good.num_events, "every other event is kept"
    assert result.stats["repaired_quotes"] == 1 and result.stats["repaired_strings"] == 1
    assert (name[:4] + b'"' + name[4:]).decode() in names(engine, result.trace_id)
    with pytest.raises(BadInputError, match="malformed strings"):
        ingest_trace(engine, io.BytesIO(bad), run_name="t2s", strict=True)


def test_t3_t4_control_bytes_invalid_utf8_backslashes_newlines(engine):
    """Made by: the ProfilerStep#551 name of sampled_rank-0 rewritten with a raw control byte,
    an invalid UTF-8 byte, a raw Windows path and a raw newline."""
    bad = _sampled_with(b'"name": "ProfilerStep#551"', b'"name": "Profiler\x01Step\xff#551 C:\\Users\\x\\model.py\nend"')
    good = ingest_trace(engine, corpus(*SAMPLED), run_name="ok")
    result = ingest_trace(engine, io.BytesIO(bad), run_name="t3")
    assert result.num_events == good.num_events
    st = result.stats
    assert (st["repaired_control_bytes"], st["repaired_utf8"], st["repaired_backslashes"], st["repaired_strings"]) == (2, 1, 3, 1)
    assert "Profiler\x01Step\ufffd#551 C:\\Users\\x\\model.py\nend" in names(engine, result.trace_id)


def test_t5_integer_above_int64_kept_exactly_as_text(engine):
    path = corpus("hta", "large_integer_trace", "rank-70.Mar_25_20_48_12.2861.pt.trace.json.gz")
    want = [e for e in json.loads(raw_json(path))["traceEvents"] if "Comms Id" in (e.get("args") or {})]
    result = ingest_trace(engine, path, run_name="t5", strict=True)
    with Session(engine) as s:
        args = [json.loads(a) for a in s.scalars(select(TraceEvent.args_json).where(TraceEvent.trace_id == result.trace_id)) if a]
    got = [a["Comms Id"] for a in args if "Comms Id" in a]
    assert got == [str(e["args"]["Comms Id"]) for e in want] and int(got[0]) > 2**63 - 1


def test_t6_distributed_info_after_events_ranks_as_string(engine, tmp_path):
    """Made by: nccl_data.json.gz with distributedInfo moved after traceEvents, its
    pg_config[0].ranks written as the string "[0, 1]" and nccl_version "unknown"."""
    doc = json.loads(raw_json(corpus(*NCCL)))
    info = doc.pop("distributedInfo")
    info["pg_config"][0]["ranks"] = "[0, 1]"
    info["nccl_version"] = "unknown"
    info["rank"] = 1
    events = doc.pop("traceEvents")
    edited = {**doc, "traceEvents": events, "distributedInfo": info}
    path = tmp_path / "after.json"
    path.write_text(json.dumps(edited))
    assert path.read_text().index('"distributedInfo"') > path.read_text().index('"traceEvents"')
    result = ingest_trace(engine, path, run_name="t6", strict=True)
    assert (result.rank, result.stats["rank_source"]) == (1, "distributedInfo")
    with Session(engine) as s:
        meta = json.loads(s.get(Trace, result.trace_id).meta_json)
    pg = process_groups(meta)
    assert pg["nccl_version"] == "unknown" and pg["world_size"] == 2
    assert pg["groups"] == [{"name": "0", "desc": "default_pg", "size": 2, "ranks": [0, 1]}]


def test_t8_overlapping_kernels_on_one_stream_kept_drawn_and_counted(engine):
    """Made by: a copy of one kernel of sampled_rank-0 added, starting half-way through it on the
    same stream (as programmatic dependent launch does)."""
    doc = json.loads(raw_json(corpus(*SAMPLED)))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel" and e.get("dur", 0) > 10]
    k = kernels[0]
    twin = {**k, "name": "overlapping_twin", "ts": k["ts"] + k["dur"] / 2}
    doc["traceEvents"].append(twin)
    result = ingest_trace(engine, io.BytesIO(json.dumps(doc).encode()), run_name="t8", strict=True)
    with Session(engine) as s:
        data = TraceData(s, result.trace_id)
        assert sum(1 for e in data.kernels if e.name == "overlapping_twin") == 1
        assert hotspots(data)["overlapping"] >= 1, "the overlap is counted"
        rows = [{"ph": "X", "name": e.name, "cat": e.cat, "ts_ns": e.ts, "dur_ns": e.dur, "pid": e.pid, "tid": e.tid}
                for e in data.gpu if e.tid == str(k["tid"])]
    fig = timeline_figure(rows)
    bars = {(n[0], y) for t in fig["data"] for n, y in zip(t.get("customdata", []), t.get("y", []))}
    twin_row = next(y for n, y in bars if n == "overlapping_twin")
    shown = k["name"].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")  # Plotly text is escaped
    orig_row = next(y for n, y in bars if n == shown[:119] or n.startswith(shown[:60]) or n.startswith(k["name"][:60]))
    assert twin_row != orig_row, "both drawn, the later one in an extra row of the lane"


def test_t9_cuda_graph_replay_kernels_link_through_correlation(engine):
    path = corpus("tracelens", "inference", "vllm_decode_full", "graph_execution.json.gz")
    evs = json.loads(raw_json(path))["traceEvents"]
    gpu = [e for e in evs if e.get("cat") == "kernel"]
    assert any("External id" not in e.get("args", {}) for e in gpu)
    result = ingest_trace(engine, path, run_name="t9", strict=True)
    with Session(engine) as s:
        data = TraceData(s, result.trace_id)
        linked = [link for link in data.links.values() if link.gpu.cat == "kernel"]
    assert len(linked) == len(gpu)
    assert all(link.runtime is not None for link in linked), "every kernel has its launch"
    launches = {link.runtime.name for link in linked}
    assert any("GraphLaunch" in n for n in launches), launches


T10_SCRIPT = r"""
import gzip, io, json, resource, sys
from graphdeck.store.db import open_engine
from graphdeck.store.traces import ingest_trace
src, copies, db = sys.argv[1], int(sys.argv[2]), sys.argv[3]
doc = json.loads(gzip.decompress(open(src, "rb").read()))
events = doc.pop("traceEvents")
span = max(e["ts"] + e.get("dur", 0) for e in events if "ts" in e) - min(e["ts"] for e in events if "ts" in e) + 1

class Repeated(io.RawIOBase):
    # the file's events N times, each copy shifted by the trace's span: bytes made as they are read
    def __init__(self):
        self.parts = self.gen(); self.buf = b""; self.total = 0
    def gen(self):
        yield b'{"traceEvents": ['
        for c in range(copies):
            chunk = [dict(e, ts=e["ts"] + c * span) if "ts" in e else e for e in events]
            yield (b"," if c else b"") + json.dumps(chunk)[1:-1].encode()
        yield b"]}"
    def readable(self): return True
    def readinto(self, b):
        while len(self.buf) < len(b):
            nxt = next(self.parts, None)
            if nxt is None: break
            self.buf += nxt
        n = min(len(b), len(self.buf)); b[:n] = self.buf[:n]; self.buf = self.buf[n:]; self.total += n
        return n

del doc
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
seen = []
r = ingest_trace(open_engine(db), io.BufferedReader(Repeated(), 65536), run_name="t10", progress=seen.append)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"events": r.num_events, "bytes": r.stats["bytes_json"], "grow_kib": peak - base, "progress": len(seen)}))
"""


def test_t10_memory_stays_flat_as_the_input_grows(tmp_path):
    """Made by: the events of sampled_rank-0 repeated 4 and 16 times with shifted timestamps,
    streamed as generated (never on disk). Peak RSS growth of the ingest must not grow with size."""
    src = str(corpus(*SAMPLED))
    out = {}
    for copies in (4, 16):
        proc = subprocess.run([sys.executable, "-c", T10_SCRIPT, src, str(copies), str(tmp_path / f"{copies}.db")],
                              capture_output=True, text=True, timeout=600, env=dict(os.environ))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[copies] = json.loads(proc.stdout.strip().splitlines()[-1])
    small, big = out[4], out[16]
    assert big["events"] == 4 * small["events"] and big["bytes"] > 3.9 * small["bytes"]
    assert big["progress"] > small["progress"] > 0, "progress is reported as batches are written"
    assert big["grow_kib"] < small["grow_kib"] + 16 * 1024, (
        f"4x the input ({big['bytes'] / 1e6:.0f} MB) may not need more memory: "
        f"{small['grow_kib']} KiB vs {big['grow_kib']} KiB")


DEEPSEEK = ("deepseek-profile-data", "train.json")


def test_t11_custom_comm_kernels_overlap_is_a_number_with_a_rule(engine):
    path = corpus(*DEEPSEEK)
    evs = json.loads(raw_json(path))["traceEvents"]
    result = ingest_trace(engine, path, run_name="t11", strict=True)
    with Session(engine) as s:
        data = TraceData(s, result.trace_id)
        plain = overlap(data)
        ruled = overlap(data, CommRule(extra=(r"dpsk::ep::",)))
    assert plain["trace"]["ratio"] is None and plain["trace"]["reason"] == "no communication kernels"
    assert any("dpsk::ep::" in u["kernel"] for u in plain["trace"]["unclassified"]), "the unclassified big kernels are named"
    r = ruled["trace"]["ratio"]
    assert isinstance(r, float) and 0.0 <= r <= 1.0, r
    comm = [e for e in evs if e.get("cat") == "kernel" and "dpsk::ep::" in e["name"]]
    assert ruled["trace"]["comm_kernels"] == len(comm)
    assert ruled["trace"]["comm_kernel_ns"] == sum(round(Decimal(str(e["dur"])) * 1000) for e in comm)
