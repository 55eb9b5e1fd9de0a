"""Trace upload, trace JSON and the Plotly timeline, over HTTP against the real app (uvicorn on a
free loopback port, a SQLite store in tmp_path), with real traces from ../shared/data/traces."""

from __future__ import annotations

import gzip
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from graphdeck.server.render.timeline import HOVER_BAR
from graphdeck.store.db import open_engine
from graphdeck.store.schema import Trace, TraceEvent
from tests.conftest import LiveServer, shared_path

SAMPLED_RANK0 = "hta/trace_filter/sampled_rank-0.json.gz"
NO_DIST_INFO = "hta/distributed_info_unavailable/distributed_info_not_found.json.gz"
LEGACY_SMALL = "kineto/tb_plugin_test_gpu_metrics_input.json"
CLIENT = {"X-Graphdeck-Client": "1"}  # graphdeck's clients send it: the server refuses writes a web page could send


def trace_file(rel: str) -> Path:
    """A corpus file; skipped when ../shared is absent, except under CI=true where it must exist."""
    return shared_path("data", "traces", rel)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("upload") / "store.db"
    open_engine(path).dispose()
    return path


@pytest.fixture(scope="module")
def client(store):
    with LiveServer(store) as server, httpx.Client(base_url=server.url, headers=CLIENT, timeout=60) as c:
        yield c


def upload(client, rel_or_path, *, run="job", data: bytes | None = None, filename: str | None = None, **params):
    path = trace_file(rel_or_path) if isinstance(rel_or_path, str) else rel_or_path
    body = path.read_bytes() if data is None else data
    return client.post(f"/api/runs/{run}/traces", params=params,
                       files={"file": (filename or path.name, body, "application/octet-stream")})


def store_counts(store: Path) -> dict:
    engine = open_engine(store, read_only=True)
    with Session(engine) as s:
        by_status = dict(s.execute(select(Trace.status, func.count()).group_by(Trace.status)).all())
        per_trace = dict(s.execute(select(TraceEvent.trace_id, func.count()).group_by(TraceEvent.trace_id)).all())
        num_events = dict(s.execute(select(Trace.id, Trace.num_events)).all())
    engine.dispose()
    return {"by_status": by_status, "rows": per_trace, "num_events": num_events}


def test_good_upload_then_trace_json_and_timeline(client):
    res = upload(client, SAMPLED_RANK0, rank=0)
    assert res.status_code == 201, res.text
    body = res.json()
    assert body["ok"] is True and body["stats"]["stored"] == 4811, "4811 X events in sampled_rank-0 (SOURCES.md)"
    tid = body["trace_id"]
    info = client.get(f"/api/traces/{tid}").json()
    assert (info["num_events"], info["status"], info["run_name"], info["rank"]) == (4811, "ok", "job", 0)
    assert info["stats"] == body["stats"] and info["meta"]["distributedInfo"]["world_size"] == 128
    assert info["name"] == "sampled_rank-0.json.gz", "the multipart file name names the trace"

    fig = client.get(f"/api/traces/{tid}/timeline").json()
    bars = [t for t in fig["data"] if t["type"] == "bar"]
    assert sum(len(t["x"]) for t in bars) == 4811, "under the default limit every X event is one bar"
    assert all(t["orientation"] == "h" for t in bars)
    assert "longest" not in fig["layout"]["title"]["text"]
    lanes = fig["layout"]["yaxis"]["categoryarray"]
    assert any(lane.startswith("GPU ") and " / stream " in lane for lane in lanes), lanes
    assert any(lane.startswith("CPU pid ") for lane in lanes), lanes
    assert lanes.index(next(x for x in lanes if x.startswith("CPU"))) < lanes.index(next(x for x in lanes if x.startswith("GPU"))), \
        "CPU lanes are listed before GPU lanes"
    assert min(min(t["base"]) for t in bars) == 0, "times are ms since the trace start"
    for t in bars:
        assert t["hovertemplate"] == HOVER_BAR, "user strings travel as customdata, never in the template"
        assert {c[1] for c in t["customdata"]} == {t["name"]}, "one bar trace per category"

    few = client.get(f"/api/traces/{tid}/timeline", params={"limit": 100}).json()
    bars_few = [t for t in few["data"] if t["type"] == "bar"]
    assert sum(len(t["x"]) for t in bars_few) == 100
    assert "100 longest of 4811" in few["layout"]["title"]["text"], "the title says only the longest are drawn"
    shortest_drawn = min(x for t in bars_few for x in t["x"])
    longest_left_out = sorted((x for t in bars for x in t["x"]), reverse=True)[100]
    assert shortest_drawn >= longest_left_out, "the 100 drawn are the 100 longest"
    assert client.get(f"/api/traces/{tid}/timeline", params={"limit": 0}).status_code == 422


def test_missing_trace_is_404_in_the_error_shape(client):
    res = client.get("/api/traces/987654")
    assert res.status_code == 404
    body = res.json()
    assert body["ok"] is False and body["status"] == 404 and "987654" in body["error"]
    assert client.get("/api/traces/987654/timeline").status_code == 404


def test_truncated_upload_is_400_and_keeps_a_consistent_trace(client, store):
    data = trace_file(SAMPLED_RANK0).read_bytes()
    res = upload(client, SAMPLED_RANK0, data=data[: len(data) // 2], run="cut")
    assert res.status_code == 400, res.text
    body = res.json()
    assert body["ok"] is False and body["status"] == 400 and "truncated" in body["error"], body["error"]
    assert body["kept"] is True and body["stats"]["truncated"] == 1 and body["num_events"] > 0
    after = store_counts(store)
    assert "ingesting" not in after["by_status"], "no trace is left half-written"
    tid = body["trace_id"]
    assert after["rows"][tid] == after["num_events"][tid] == body["num_events"], \
        "the kept events are exactly the trace's num_events"
    assert client.get(f"/api/traces/{tid}").json()["status"] == "truncated"


def test_strict_truncated_upload_keeps_nothing(client, store):
    before = store_counts(store)
    data = trace_file(SAMPLED_RANK0).read_bytes()
    res = upload(client, SAMPLED_RANK0, data=data[: len(data) // 2], run="strict", strict="true")
    assert res.status_code == 400 and "truncated" in res.json()["error"]
    assert res.json()["kept"] is False
    assert store_counts(store) == before, "strict: no trace row and no event kept"


def test_not_json_upload_is_400(client, store, tmp_path):
    before = store_counts(store)
    path = tmp_path / "notes.json"
    path.write_text("definitely { not json")
    res = upload(client, path, run="bad")
    assert res.status_code == 400 and "not valid JSON" in res.json()["error"], res.text
    res = client.post("/api/runs/bad/traces", files={"other": ("x.json", b"{}")})
    assert res.status_code == 400 and "'file'" in res.json()["error"], "a missing 'file' field is named"
    assert store_counts(store) == before


def test_raw_body_upload_rank_from_name_and_gpu_lanes(client):
    data = trace_file(NO_DIST_INFO).read_bytes()
    res = client.post("/api/runs/raw/traces", params={"name": "host_rank_3.json.gz"}, content=data,
                      headers={"content-type": "application/gzip"})
    assert res.status_code == 201, res.text
    assert (res.json()["rank"], res.json()["stats"]["rank_source"]) == (3, "filename")
    res = upload(client, LEGACY_SMALL, run="raw", rank=1)
    assert res.status_code == 201 and res.json()["rank"] == 1, "no distributedInfo: the rank query parameter"
    fig = client.get(f"/api/traces/{res.json()['trace_id']}/timeline").json()
    lanes = fig["layout"]["yaxis"]["categoryarray"]
    assert "GPU 0 / stream 7" in lanes, f"legacy string tid 'stream 7' on GPU 0 becomes its lane: {lanes}"


def test_upload_over_the_cap_is_413(store, tmp_path):
    small = tmp_path / "small.db"
    open_engine(small).dispose()
    data = trace_file(SAMPLED_RANK0).read_bytes()
    with LiveServer(small, max_upload_bytes=10_000) as server, \
            httpx.Client(base_url=server.url, headers=CLIENT, timeout=60) as c:
        res = c.post("/api/runs/big/traces", files={"file": ("a.json.gz", data)})
        assert res.status_code == 413 and res.json()["status"] == 413, res.text

        def chunks():  # no Content-Length: the cap is enforced while streaming
            for i in range(0, len(data), 4096):
                yield data[i : i + 4096]

        res = c.post("/api/runs/big/traces", content=chunks(), headers={"content-type": "application/gzip"})
        assert res.status_code == 413, res.text
        res = c.post("/api/runs/big/traces", files={"file": ("tiny.json", gzip.compress(b'{"traceEvents": []}'))})
        assert res.status_code == 201, "an upload under the cap is accepted"
    assert store_counts(small)["num_events"] == {1: 0}


def test_timeline_figure_is_pure_and_names_lanes():
    from graphdeck.server.render.timeline import timeline_figure

    events = [
        {"ph": "X", "name": "<b>aten::mm</b>", "cat": "cpu_op", "ts_ns": 1_000_000, "dur_ns": 5_000, "pid": "42", "tid": "7"},
        {"ph": "X", "name": "sgemm", "cat": "kernel", "ts_ns": 1_002_000, "dur_ns": 3_000, "pid": "0", "tid": "7"},
        {"ph": "i", "name": "Record Window End", "cat": None, "ts_ns": 1_010_000, "dur_ns": 0, "pid": "", "tid": ""},
    ]
    fig = timeline_figure(events, process_labels={"0": "GPU 0"}, thread_names={"42/7": "thread 7 (python)"})
    assert fig == timeline_figure(list(events), process_labels={"0": "GPU 0"}, thread_names={"42/7": "thread 7 (python)"}), \
        "same events, same figure"
    assert fig["layout"]["yaxis"]["categoryarray"] == ["CPU pid 42 / tid 7 (python)", "GPU 0 / stream 7", "global"]
    bar = next(t for t in fig["data"] if t["name"] == "cpu_op")
    assert (bar["base"], bar["x"], bar["customdata"]) == ([0.0], [0.005], [["&lt;b&gt;aten::mm&lt;/b&gt;", "cpu_op", 5.0]]), \
        "start 0 ms, 5 µs = 0.005 ms; the name stays data (escaped: Plotly reads it as markup), the template constant"
    assert bar["hovertemplate"] == HOVER_BAR
