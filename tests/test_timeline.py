"""The Plotly timeline: nesting depth rows, hover, colours, size, and a real Kineto trace served over
HTTP (``sampled_rank-0.json.gz``, ingested into a SQLite store in tmp_path) whose rows never
hold two overlapping bars."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import defaultdict

import httpx
import pytest

from graphdeck.server.render.timeline import (
    HOVER_BAR,
    KINETO_CATEGORIES,
    MAX_DEPTH_ROWS,
    MAX_HEIGHT_PX,
    PALETTE,
    category_colors,
    event_depths,
    timeline_figure,
)
from graphdeck.store.db import open_engine
from graphdeck.store.traces import ingest_trace
from tests.conftest import LiveServer, shared_path

SAMPLED_RANK0 = ("data", "traces", "hta", "trace_filter", "sampled_rank-0.json.gz")
PYTHON = "CPU pid 1 / tid 2 (python)"


def x(name: str, ts_us: float, dur_us: float, *, cat: str = "cpu_op", pid="1", tid="2") -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts_ns": int(ts_us * 1000), "dur_ns": int(dur_us * 1000),
            "pid": pid, "tid": tid}


#: (event, expected depth). Times in µs. A step holding two ops that touch end to start (siblings,
#: not nested), children of each, a child that outlives its parent by 5 ns-scale rounding (it goes
#: one row deeper rather than overlapping), a second thread starting at the same time (depth 0 in
#: its own lane), and an instant (depth 0).
NEST = [
    (x("ProfilerStep#1", 0, 1000, cat="user_annotation"), 0),
    (x("aten::linear", 10, 390), 1),
    (x("aten::addmm", 20, 80), 2),
    (x("aten::t", 100, 100), 2),           # starts where addmm ends: a sibling
    (x("aten::as_strided", 120, 10), 3),
    (x("aten::relu", 400, 500), 1),        # starts where linear ends: a sibling of linear
    (x("aten::clamp_min", 500, 100), 2),
    (x("rounding", 890, 10.005), 2),       # ends 5 ns after relu ends
    (x("after", 900.004, 20), 3),           # relu is over, but "rounding" still is open
    (x("ProfilerStep#2", 1000, 500, cat="user_annotation"), 0),
    (x("gloo:all_reduce", 0, 50, cat="user_annotation", tid="3"), 0),
    ({"ph": "i", "name": "mark", "cat": None, "ts_ns": 5_000, "dur_ns": 0, "pid": "1", "tid": "2"}, 0),
]
THREADS = {"1/2": "thread 2 (python)", "1/3": "thread 3 (gloo)"}


def bars_by_name(fig: dict) -> dict[str, tuple[str, float, float]]:
    """event name → (row, start ms, duration ms) over every bar trace."""
    out = {}
    for t in fig["data"]:
        if t["type"] == "bar":
            for y, base, dur, cd in zip(t["y"], t["base"], t["x"], t["customdata"]):
                out[cd[0]] = (y, base, dur)
    return out


def overlaps_in_rows(fig: dict) -> list[tuple]:
    """Pairs of bars drawn in the same row whose [start, end) intervals overlap (in integer ns)."""
    per_row = defaultdict(list)
    for t in fig["data"]:
        if t["type"] == "bar":
            for y, base, dur, cd in zip(t["y"], t["base"], t["x"], t["customdata"]):
                start_ns = round(base * 1e6)
                per_row[y].append((start_ns, start_ns + round(dur * 1e6), cd[0]))
    bad = []
    for row, spans in per_row.items():
        spans.sort()
        for a, b in itertools.pairwise(spans):
            if b[0] < a[1]:
                bad.append((row, a, b))
    return bad


def test_event_depths_of_a_hand_made_nest():
    events = [e for e, _ in NEST]
    assert event_depths(events) == [d for _, d in NEST]
    shuffled = list(range(len(events)))
    random.Random(0).shuffle(shuffled)
    depths = event_depths([events[i] for i in shuffled])
    assert [depths[shuffled.index(i)] for i in range(len(events))] == [d for _, d in NEST], \
        "depth depends on times, not on the order events arrive in"


def test_depth_rows_in_the_figure():
    fig = timeline_figure([e for e, _ in NEST], thread_names=THREADS)
    rows = fig["layout"]["yaxis"]["categoryarray"]
    assert rows == [f"{PYTHON} · {d}" for d in range(4)] + ["CPU pid 1 / tid 3 (gloo)"], \
        "lane-major then depth; a lane with one row keeps the plain lane label"
    assert fig["layout"]["yaxis"]["autorange"] == "reversed", "lane 0, depth 0 on top"
    assert fig["layout"]["yaxis"]["ticktext"] == [PYTHON, "· 1", "· 2", "· 3", "CPU pid 1 / tid 3 (gloo)"]
    drawn = bars_by_name(fig)
    for event, depth in NEST:
        if event["ph"] == "X" and event["tid"] == "2":
            assert drawn[event["name"]][0] == f"{PYTHON} · {depth}", f"{event['name']} is drawn on depth row {depth}"
    assert drawn["aten::linear"][1:] == (0.01, 0.39), "start 10 µs = 0.01 ms, 390 µs long"
    assert overlaps_in_rows(fig) == [], "no two bars share time in one row"
    instants = next(t for t in fig["data"] if t["type"] == "scatter")
    assert instants["y"] == [f"{PYTHON} · 0"], "instants sit on their lane's row 0"
    assert fig["layout"]["meta"]["folded_events"] == 0 and "nested deeper" not in fig["layout"]["title"]["text"]


def test_hover_names_the_bar_under_the_cursor():
    fig = timeline_figure([e for e, _ in NEST], thread_names=THREADS)
    for t in fig["data"]:
        if t["type"] == "bar":
            assert t["hovertemplate"] == HOVER_BAR, "a constant template: user strings stay data"
            assert t["textposition"] == "none" and t["text"] == t["y"], "text carries the full row label for hover only"
    for field in ("customdata[0]", "customdata[1]", "customdata[2]} µs", "%{base:.6f} ms", "%{text}"):
        assert field in HOVER_BAR, f"hover shows name, category, duration µs, start ms and row ({field})"
    assert fig["layout"]["barmode"] == "overlay" and fig["layout"]["hovermode"] == "closest"


def test_same_events_same_figure_bytes():
    events = [e for e, _ in NEST]
    a = timeline_figure(events, thread_names=THREADS, title="t")
    b = timeline_figure([dict(e) for e in events], thread_names=dict(THREADS), title="t")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), "same input, same bytes"


def test_deep_nesting_is_folded_into_the_last_row_and_said():
    deep = [x(f"level{d}", d, 1000 - 2 * d) for d in range(MAX_DEPTH_ROWS + 3)]
    fig = timeline_figure(deep, thread_names=THREADS)
    rows = fig["layout"]["yaxis"]["categoryarray"]
    assert len(rows) == MAX_DEPTH_ROWS, f"{MAX_DEPTH_ROWS + 3} levels drawn in {MAX_DEPTH_ROWS} rows"
    drawn = bars_by_name(fig)
    assert {drawn[f"level{d}"][0] for d in range(MAX_DEPTH_ROWS - 1, MAX_DEPTH_ROWS + 3)} == {rows[-1]}
    assert fig["layout"]["meta"]["folded_events"] == 3
    assert f"3 events nested deeper than {MAX_DEPTH_ROWS} levels" in fig["layout"]["title"]["text"]


def test_height_grows_with_rows_and_is_capped():
    one = timeline_figure([x("a", 0, 1)])["layout"]["height"]
    nested = timeline_figure([x(f"l{d}", d, 100 - d) for d in range(10)])["layout"]["height"]
    lanes = [x(f"t{t}-l{d}", d, 100 - d, tid=str(t)) for t in range(40) for d in range(MAX_DEPTH_ROWS)]
    many = timeline_figure(lanes)["layout"]["height"]
    assert one < nested < many == MAX_HEIGHT_PX, (one, nested, many)


def _lab(hex_colour: str) -> tuple[float, float, float]:
    """sRGB hex → CIELAB (D65), for a perceptual distance between two colours."""
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(int(hex_colour[i : i + 2], 16) / 255) for i in (1, 3, 5))
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = (v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def test_category_colours_are_clearly_distinct_and_stable():
    four = ["user_annotation", "cpu_op", "kernel", "cuda_runtime"]
    colours = category_colors(four)
    for a, b in itertools.combinations(four, 2):
        assert math.dist(_lab(colours[a]), _lab(colours[b])) > 60, \
            f"{a} {colours[a]} and {b} {colours[b]} must be told apart at a glance (CIELAB ΔE > 60)"
    assert category_colors(["cpu_op", "user_annotation", "Trace", "my_cat"])["cpu_op"] == colours["cpu_op"], \
        "Kineto categories keep their colour whatever else is in the trace (ranks compare at a glance)"
    assert category_colors(["Operator", "Kernel"]) == {"Operator": colours["cpu_op"], "Kernel": colours["kernel"]}, \
        "2021 spellings take the current name's colour"
    every = list(KINETO_CATEGORIES) + ["fwdbwd", "overhead"]
    assert len(set(category_colors(every).values())) == len(every) == len(PALETTE), \
        "up to len(PALETTE) categories in one figure all get distinct colours"
    fig = timeline_figure([x(c, i, 1, cat=c) for i, c in enumerate(four)])
    drawn = {t["name"]: t["marker"]["color"] for t in fig["data"]}
    assert drawn == colours and len(set(drawn.values())) == 4


@pytest.fixture(scope="module")
def sampled_server(tmp_path_factory):
    store = tmp_path_factory.mktemp("timeline") / "store.db"
    engine = open_engine(store)
    result = ingest_trace(engine, shared_path(*SAMPLED_RANK0), run_name="job", strict=True)
    engine.dispose()
    with LiveServer(store) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, result.trace_id


def test_real_trace_rows_never_overlap(sampled_server):
    client, trace_id = sampled_server
    fig = client.get(f"/api/traces/{trace_id}/timeline").json()
    meta = fig["layout"]["meta"]
    assert meta["shown_events"] == 4811 and meta["folded_events"] == 0, \
        "all 4811 X events of sampled_rank-0 drawn, none deeper than the row cap"
    assert overlaps_in_rows(fig) == [], "in every depth row the bars are disjoint in time"
    rows = fig["layout"]["yaxis"]["categoryarray"]
    assert len(rows) > len(meta["lanes"]), "nested CPU ops get rows of their own under their lane"
    cpu = [r for r in rows if r.startswith("CPU")]
    assert cpu[0].endswith(" · 0") and rows.index(cpu[0]) < min(rows.index(r) for r in rows if r.startswith("GPU")), \
        "CPU lanes (row 0 first) above GPU lanes"
    colours = {t["name"]: t["marker"]["color"] for t in fig["data"] if t["type"] == "bar"}
    assert {"cpu_op", "kernel", "cuda_runtime"} <= colours.keys(), colours
    assert len(set(colours.values())) == len(colours), f"each category of the trace has its own colour: {colours}"


def test_real_trace_limit_keeps_the_longest(sampled_server):
    client, trace_id = sampled_server
    fig = client.get(f"/api/traces/{trace_id}/timeline", params={"limit": 300}).json()
    assert fig["layout"]["meta"]["shown_events"] == 300
    assert "300 longest of 4811" in fig["layout"]["title"]["text"]
    assert overlaps_in_rows(fig) == [], "depth rows are computed over the drawn subset, still disjoint"
