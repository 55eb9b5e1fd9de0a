"""Render trace events as a Plotly timeline figure (a JSON dict the dashboard hands to Plotly).

:func:`timeline_figure` is pure: the same events give the same dict. Lanes are one per
``(pid, tid)``, ordered CPU lanes first, then GPU lanes, then the rest, numerically where ids are
numbers. Each lane is drawn as one row per nesting depth (see NOTE: [Depth rows]), so the y
categories are the rows, lane-major then depth. Bars are one Plotly trace per event category, so
the legend toggles a category; colours come from a qualitative palette (see
:func:`category_colors`). Times are milliseconds since ``start_ns`` (the trace's first event by
default).

User strings (event names, categories, thread names, the title) only ever travel as data (``y``,
``text``, ``customdata``, trace names); the ``hovertemplate`` is a constant. Plotly still reads
that text as its pseudo-HTML (``<a href>`` became a clickable external link), so every user
string is escaped for it first (:func:`~graphdeck.server.render.xmltext.plotly_text`).
Hover names the row through ``text`` (the full row label; ``textposition="none"`` keeps it off
the bar) because ``%{y}`` would give the short tick text.

# NOTE: [Depth rows]
Kineto ``X`` events on one thread nest: ``ProfilerStep#3`` contains ``aten::linear`` contains
``aten::addmm``. Drawn in one row with ``barmode="overlay"`` the outer bar hides thousands of
inner ones and hover reports only the top bar. So, like Perfetto and chrome://tracing flame
rows, each lane is split by depth: per lane, events sorted by start ascending and duration
descending go through a stack sweep (pop every open event that ends at or before this start;
the depth is what is left open), and depth ``d`` is drawn in row ``d`` of the lane. An event is
only placed on a row whose previous occupant has ended, so bars in one row never overlap, even
where Kineto's rounding makes a child outlive its parent by a few ns (that child just goes one
row deeper). At most :data:`MAX_DEPTH_ROWS` rows are drawn per lane; deeper events are folded
into the last row (where they may overlap) and the title says how many were folded. A lane with
one row is labelled as the lane; otherwise its rows are ``"<lane> · <depth>"``, and the axis
ticks show the lane name on row 0 and ``· d`` below it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from graphdeck.server.render.palette import hash_slots
from graphdeck.server.render.xmltext import plotly_text

#: Kineto categories of events that run on a GPU stream (current and 2021 spellings).
GPU_CATEGORIES = frozenset(
    {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "Kernel", "Memcpy", "Memset", "mtia_ops"}
)
HOVER_BAR = (
    "%{customdata[0]}<br>category: %{customdata[1]}<br>dur: %{customdata[2]} µs"
    "<br>start: %{base:.6f} ms<br>%{text}<extra></extra>"
)
HOVER_INSTANT = "%{customdata[0]}<br>category: %{customdata[1]}<br>instant at %{x:.6f} ms<br>%{text}<extra></extra>"
MAX_LABEL_CHARS = 120
#: Depth rows drawn per lane; deeper events share the last row (see NOTE: [Depth rows]).
MAX_DEPTH_ROWS = 12
#: Figure height: this many px per row plus the title and axis, clamped to the bounds below.
ROW_HEIGHT_PX = 20
MIN_HEIGHT_PX = 320
MAX_HEIGHT_PX = 2400

#: Qualitative palette: D3's category10 without its grey (grey is the instants' colour), plus
#: navy, dark teal and mint; every pair is at least 27 apart in CIELAB (ΔE76). The order is
#: chosen so that the md5 slots (with probing) put the Kineto categories where they are told
#: apart best: user_annotation orange, cpu_op green, kernel navy, cuda_runtime cyan (these four
#: at least 70 apart), gpu_user_annotation red beside the kernels, Trace blue.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#000080", "#d62728", "#8c564b",
    "#e377c2", "#9467bd", "#004d40", "#17becf", "#aaffc3", "#bcbd22",
)
#: Kineto categories whose colours are fixed for every trace (assigned in this order).
KINETO_CATEGORIES = (
    "user_annotation", "cpu_op", "kernel", "cuda_runtime", "gpu_user_annotation",
    "gpu_memcpy", "gpu_memset", "cuda_driver", "python_function", "Trace",
)
#: 2021 Kineto spellings coloured like their current names.
_CATEGORY_ALIASES = {"Operator": "cpu_op", "Runtime": "cuda_runtime", "Kernel": "kernel",
                     "Memcpy": "gpu_memcpy", "Memset": "gpu_memset"}


_KINETO_SLOTS = hash_slots(KINETO_CATEGORIES, len(PALETTE))


def category_colors(categories: Iterable[str]) -> dict[str, str]:
    """``category → "#rrggbb"`` for the categories of one figure, distinct while there are at
    most ``len(PALETTE)`` of them.

    The :data:`KINETO_CATEGORIES` (and their 2021 aliases) have the same colour in every
    figure, so ranks compare at a glance; any other category takes its hash slot, probing past
    the colours already used in this figure (other categories in sorted order).

    >>> category_colors(["cpu_op", "user_annotation"])
    {'cpu_op': '#2ca02c', 'user_annotation': '#ff7f0e'}
    """
    cats = sorted(set(categories))
    canonical = {c: _CATEGORY_ALIASES.get(c, c) for c in cats}
    slots = {c: _KINETO_SLOTS[canonical[c]] for c in cats if canonical[c] in _KINETO_SLOTS}
    slots.update(hash_slots([c for c in cats if c not in slots], len(PALETTE), set(slots.values())))
    return {c: PALETTE[slots[c]] for c in cats}


def _num(text: str) -> tuple[int, Any]:
    """Sort key: numbers by value before strings."""
    try:
        return (0, int(text))
    except ValueError:
        return (1, text)


def _short(text: str) -> str:
    return text if len(text) <= MAX_LABEL_CHARS else text[: MAX_LABEL_CHARS - 1] + f"…[total_len={len(text)}]"


def lane_label(pid: str, tid: str, *, gpu: bool, process_label: str | None = None) -> str:
    """``"CPU pid 123 / tid 456"``, ``"GPU 0 / stream 7"``, ``"<pid> / <tid>"`` for named lanes,
    ``"global"`` for events without pid and tid (global-scope instants)."""
    if not pid and not tid:
        return "global"
    if gpu:
        device = pid
        if process_label and process_label.startswith("GPU "):
            device = process_label[4:]
        stream = tid[7:] if tid.startswith("stream ") else tid
        return _short(f"GPU {device} / stream {stream}")
    if _num(pid)[0] == 0:
        return _short(f"CPU pid {pid} / tid {tid}")
    return _short(f"{pid} / {tid}")


def split_rank_pid(pid: str) -> tuple[int | None, str]:
    """``"r3:1234"`` (a multi-rank figure's lane pid, see :func:`rank_pid`) → ``(3, "1234")``;
    any other pid → ``(None, pid)``."""
    if pid.startswith("r") and ":" in pid:
        head, _, rest = pid.partition(":")
        if head[1:].isdigit():
            return int(head[1:]), rest
    return None, pid


def rank_pid(rank: int, pid: str) -> str:
    """The pid of a lane in a multi-rank figure: ranks stack in rank order, each labelled."""
    return f"r{rank}:{pid}"


def _lanes(events: list[Mapping], process_labels: Mapping[str, str], thread_names: Mapping[str, str],
           rank_order: Sequence[int] | None = None) -> dict:
    """(pid, tid) → display label, for every lane in ``events``; lanes of pids made by
    :func:`rank_pid` are grouped by rank (rank-major: ``rank_order``'s order, else by rank) and
    labelled ``rank N · ...``."""
    place = {r: i for i, r in enumerate(rank_order or [])}
    gpu: dict[tuple[str, str], bool] = {}
    for e in events:
        key = (str(e["pid"]), str(e["tid"]))
        if not gpu.get(key):
            gpu[key] = (
                e.get("cat") in GPU_CATEGORIES
                or key[1].startswith("stream")
                or str(process_labels.get(key[0], "")).startswith("GPU")
            )
    labels: dict[tuple[str, str], str] = {}
    for (full_pid, tid), is_gpu in gpu.items():
        rank, pid = split_rank_pid(full_pid)
        label = lane_label(pid, tid, gpu=is_gpu, process_label=process_labels.get(full_pid, process_labels.get(pid)))
        if rank is not None:
            label = _short(f"rank {rank} · {label}")
        thread = thread_names.get(f"{full_pid}/{tid}") or thread_names.get(f"{pid}/{tid}")
        if thread and thread.startswith(f"thread {tid} ("):  # Kineto's "thread 542 (python3)"
            thread = thread[len(f"thread {tid} (") : -1] if thread.endswith(")") else thread
        if thread and not is_gpu:
            label = _short(f"{label} ({thread})")
        labels[(full_pid, tid)] = plotly_text(label)

    def order(key: tuple[str, str]) -> tuple:
        rank, pid = split_rank_pid(key[0])
        tid = key[1]
        kind = 1 if gpu[key] else 0 if _num(pid)[0] == 0 else 2
        return (place.get(rank, len(place)) if rank is not None else -1, rank if rank is not None else -1,
                kind, _num(pid), _num(tid))

    return {key: labels[key] for key in sorted(labels, key=order)}


def event_depths(events: Sequence[Mapping[str, Any]]) -> list[int]:
    """The nesting depth of each event within its lane ``(pid, tid)``, by a stack sweep.

    Args:
        events: mappings with ``ph``, ``ts_ns``, ``dur_ns``, ``pid``, ``tid`` (and ``name``,
            ``cat`` as tie-breakers for equal start and duration).

    Returns:
        ``depths[i]`` for ``events[i]``: 0 for an event nothing open encloses, ``d + 1`` inside
        an event of depth ``d``; non-``X`` events (instants) are 0. Per lane, events are swept
        by start ascending, duration descending; an open event ending at or before the next
        start is closed first (see NOTE: [Depth rows]).

    >>> ev = lambda ts, dur: {"ph": "X", "ts_ns": ts, "dur_ns": dur, "pid": 1, "tid": 1}
    >>> event_depths([ev(0, 100), ev(10, 50), ev(20, 10), ev(60, 40), ev(100, 5)])
    [0, 1, 2, 1, 0]
    """
    by_lane: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        if e.get("ph") == "X":
            by_lane[(str(e["pid"]), str(e["tid"]))].append(i)
    depths = [0] * len(events)

    def order(i: int) -> tuple:
        e = events[i]
        dur_ns = max(int(e.get("dur_ns") or 0), 0)
        return (int(e["ts_ns"]), -dur_ns, str(e.get("name") or ""), str(e.get("cat") or ""), i)

    for indices in by_lane.values():
        open_ends_ns: list[int] = []
        for i in sorted(indices, key=order):
            start_ns = int(events[i]["ts_ns"])
            while open_ends_ns and open_ends_ns[-1] <= start_ns:
                open_ends_ns.pop()
            depths[i] = len(open_ends_ns)
            open_ends_ns.append(start_ns + max(int(events[i].get("dur_ns") or 0), 0))
    return depths


def _rows(lanes: Mapping[tuple[str, str], str], depth_rows: Mapping[tuple[str, str], int]) -> dict:
    """``(pid, tid, depth) → row label`` in display order (lane-major, then depth)."""
    rows = {}
    for key, label in lanes.items():
        n = depth_rows.get(key, 1)
        for d in range(n):
            rows[(*key, d)] = label if n == 1 else f"{label} · {d}"
    return rows


def timeline_figure(
    events: Iterable[Mapping[str, Any]],
    *,
    start_ns: int | None = None,
    title: str = "",
    total_events: int | None = None,
    process_labels: Mapping[str, str] | None = None,
    thread_names: Mapping[str, str] | None = None,
    rank_order: Sequence[int] | None = None,
) -> dict:
    """A Plotly figure ``{"data": [...], "layout": {...}}`` of ``events`` as horizontal bars.

    Args:
        events: mappings with ``name``, ``cat`` (or None), ``ph`` (``X`` bars; ``i``/``I``
            markers), ``ts_ns``, ``dur_ns``, ``pid``, ``tid`` — rows of ``trace_events``.
        start_ns: time origin; default the earliest ``ts_ns`` in ``events``.
        title: the figure title.
        total_events: how many events the trace has when ``events`` is a subset (the longest N);
            the title then says "N longest of M".
        process_labels: ``pid → "GPU 0" | "CPU"`` (Kineto ``process_labels`` metadata).
        thread_names: ``"pid/tid" → name`` (Kineto ``thread_name`` metadata).
        rank_order: the ranks of a multi-rank figure top to bottom (default: by rank).

    Returns:
        A JSON-ready dict: one ``bar`` trace per category (``orientation="h"``, ``y`` = the
        event's depth row, ``base`` = start in ms, ``x`` = duration in ms, ``customdata`` =
        [name, category, duration in µs]) and one ``scatter`` of instants (on their lane's row
        0). ``layout.yaxis.categoryarray`` lists the rows top to bottom (lane-major, then depth;
        see NOTE: [Depth rows]); ``layout.meta`` has ``lanes``, ``rows``, ``shown_events``,
        ``total_events``, ``folded_events`` (events deeper than :data:`MAX_DEPTH_ROWS` drawn in
        their lane's last row) and ``start_ns``.
    """
    event_list = list(events)
    lanes = _lanes(event_list, process_labels or {}, thread_names or {}, rank_order)
    depths = event_depths(event_list)
    depth_rows: dict[tuple[str, str], int] = {}
    for e, depth in zip(event_list, depths):
        key = (str(e["pid"]), str(e["tid"]))
        depth_rows[key] = max(depth_rows.get(key, 1), min(depth, MAX_DEPTH_ROWS - 1) + 1)
    rows = _rows(lanes, depth_rows)
    origin = start_ns if start_ns is not None else min((int(e["ts_ns"]) for e in event_list), default=0)
    bars: dict[str, dict[str, list]] = defaultdict(lambda: {"y": [], "base": [], "x": [], "customdata": []})
    instants: dict[str, list] = {"y": [], "x": [], "customdata": []}
    folded = 0
    for e, depth in zip(event_list, depths):
        cat = e.get("cat") or "(none)"
        pid, tid = str(e["pid"]), str(e["tid"])
        name = plotly_text(_short(str(e.get("name") or "")))
        start_ms = round((int(e["ts_ns"]) - origin) / 1e6, 6)
        if e.get("ph") == "X":
            folded += depth >= MAX_DEPTH_ROWS
            dur_ns = max(int(e.get("dur_ns") or 0), 0)
            b = bars[cat]
            b["y"].append(rows[(pid, tid, min(depth, MAX_DEPTH_ROWS - 1))])
            b["base"].append(start_ms)
            b["x"].append(round(dur_ns / 1e6, 6))
            b["customdata"].append([name, plotly_text(cat), round(dur_ns / 1e3, 3)])
        else:
            instants["y"].append(rows[(pid, tid, 0)])
            instants["x"].append(start_ms)
            instants["customdata"].append([name, plotly_text(cat)])
    colors = category_colors(bars)
    # NOTE: [Plain figure dicts] The figure is built as the plain JSON Plotly.js reads rather than
    # through plotly.graph_objects: validating and serialising 2000 bars there took ~0.5 s, which
    # a zoom pays on every window (bench/RESULTS.md, "Trace ingest"). Same keys, same values.
    data: list[dict] = []
    for cat in sorted(bars):
        b = bars[cat]
        data.append({
            "type": "bar", "name": plotly_text(_short(cat)), "orientation": "h", "y": b["y"], "base": b["base"], "x": b["x"],
            "customdata": b["customdata"], "text": b["y"], "textposition": "none", "hovertemplate": HOVER_BAR,
            "marker": {"color": colors[cat], "line": {"width": 0}},
        })
    if instants["x"]:
        data.append({
            "type": "scatter", "name": "instant events", "mode": "markers", "y": instants["y"], "x": instants["x"],
            "customdata": instants["customdata"], "text": instants["y"], "hovertemplate": HOVER_INSTANT,
            "marker": {"symbol": "line-ns-open", "size": 12, "color": "#444"},
        })
    shown = sum(len(b["x"]) for b in bars.values())
    heading = plotly_text(title) if title else "Trace timeline"
    if total_events is not None and total_events > shown:
        heading += f" — showing the {shown} longest of {total_events} events"
    if folded:
        heading += f" — {folded} events nested deeper than {MAX_DEPTH_ROWS} levels drawn in their lane's last row"
    row_order = list(rows.values())
    layout = {
        "title": {"text": heading},
        "barmode": "overlay",
        "bargap": 0.15,
        "hovermode": "closest",
        "height": min(MAX_HEIGHT_PX, max(MIN_HEIGHT_PX, ROW_HEIGHT_PX * len(row_order) + 140)),
        "margin": {"l": 10, "r": 10, "t": 50, "b": 40},
        "xaxis": {"title": {"text": "ms since trace start"}, "zeroline": False, "gridcolor": "#ebf0f8"},
        "yaxis": {"type": "category", "categoryorder": "array", "categoryarray": row_order,
                  "tickmode": "array", "tickvals": row_order,
                  "ticktext": [lanes[(pid, tid)] if d == 0 else f"· {d}" for pid, tid, d in rows],
                  "autorange": "reversed", "automargin": True, "showgrid": False},
        "shapes": _lane_bands(rows),
        "legend": {"title": {"text": "category"}},
        "paper_bgcolor": "white", "plot_bgcolor": "white", "font": {"color": "#2a3f5f"},
        "meta": {"lanes": list(lanes.values()), "rows": row_order, "shown_events": shown,
                 "total_events": total_events, "folded_events": folded, "start_ns": origin},
    }
    return {"data": data, "layout": layout}


def _lane_bands(rows: Mapping[tuple[str, str, int], str]) -> list[dict]:
    """A light band behind every other lane's rows, so a lane's depth rows read as one group."""
    spans: dict[tuple[str, str], list[int]] = {}
    for index, (pid, tid, _depth) in enumerate(rows):
        spans.setdefault((pid, tid), []).append(index)
    return [
        {"type": "rect", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": span[0] - 0.5, "y1": span[-1] + 0.5,
         "fillcolor": "rgba(60,80,120,0.06)", "line": {"width": 0}, "layer": "below"}
        for n, span in enumerate(spans.values()) if n % 2 == 1
    ]
