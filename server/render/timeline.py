"""Render trace events as a Plotly timeline figure (a JSON dict the dashboard hands to Plotly).

:func:`timeline_figure` is pure: the same events give the same dict. Lanes (the y categories)
are one per ``(pid, tid)``, ordered CPU lanes first, then GPU lanes, then the rest, numerically
where ids are numbers. Bars are one Plotly trace per event category, so the legend toggles a
category; colours come from a hash of the category name. Times are milliseconds since
``start_ns`` (the trace's first event by default).

User strings (event names, categories, thread names) only ever travel as data (``y``,
``customdata``, trace names); the ``hovertemplate`` is a constant, so a name cannot add markup.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

#: Kineto categories of events that run on a GPU stream (current and 2021 spellings).
GPU_CATEGORIES = frozenset(
    {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "Kernel", "Memcpy", "Memset", "mtia_ops"}
)
HOVER_BAR = "%{customdata[0]}<br>category: %{customdata[1]}<br>dur: %{customdata[2]} µs<br>lane: %{y}<extra></extra>"
HOVER_INSTANT = "%{customdata[0]}<br>category: %{customdata[1]}<br>instant<br>lane: %{y}<extra></extra>"
MAX_LABEL_CHARS = 120


def _num(text: str) -> tuple[int, Any]:
    """Sort key: numbers by value before strings."""
    try:
        return (0, int(text))
    except ValueError:
        return (1, text)


def _short(text: str) -> str:
    return text if len(text) <= MAX_LABEL_CHARS else text[: MAX_LABEL_CHARS - 1] + f"…[total_len={len(text)}]"


def category_colour(cat: str) -> str:
    """A stable colour for a category name: ``hsl(h, 55%, 52%)`` with ``h`` from its MD5."""
    h = int(hashlib.md5(cat.encode("utf-8")).hexdigest()[:6], 16) % 360
    return f"hsl({h},55%,52%)"


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


def _lanes(events: list[Mapping], process_labels: Mapping[str, str], thread_names: Mapping[str, str]) -> dict:
    """(pid, tid) → display label, for every lane in ``events``."""
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
    for (pid, tid), is_gpu in gpu.items():
        label = lane_label(pid, tid, gpu=is_gpu, process_label=process_labels.get(pid))
        thread = thread_names.get(f"{pid}/{tid}")
        if thread and thread.startswith(f"thread {tid} ("):  # Kineto's "thread 542 (python3)"
            thread = thread[len(f"thread {tid} (") : -1] if thread.endswith(")") else thread
        if thread and not is_gpu:
            label = _short(f"{label} ({thread})")
        labels[(pid, tid)] = label

    def order(key: tuple[str, str]) -> tuple:
        pid, tid = key
        kind = 1 if gpu[key] else 0 if _num(pid)[0] == 0 else 2
        return (kind, _num(pid), _num(tid))

    return {key: labels[key] for key in sorted(labels, key=order)}


def timeline_figure(
    events: Iterable[Mapping[str, Any]],
    *,
    start_ns: int | None = None,
    title: str = "",
    total_events: int | None = None,
    process_labels: Mapping[str, str] | None = None,
    thread_names: Mapping[str, str] | None = None,
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

    Returns:
        A JSON-ready dict: one ``bar`` trace per category (``orientation="h"``, ``base`` = start
        in ms, ``x`` = duration in ms, ``customdata`` = [name, category, duration in µs]) and one
        ``scatter`` of instants, with lanes as the y categories in display order.
    """
    import plotly.graph_objects as go

    rows = list(events)
    lanes = _lanes(rows, process_labels or {}, thread_names or {})
    origin = start_ns if start_ns is not None else min((int(e["ts_ns"]) for e in rows), default=0)
    bars: dict[str, dict[str, list]] = defaultdict(lambda: {"y": [], "base": [], "x": [], "customdata": []})
    instants: dict[str, list] = {"y": [], "x": [], "customdata": []}
    for e in rows:
        cat = e.get("cat") or "(none)"
        lane = lanes[(str(e["pid"]), str(e["tid"]))]
        name = _short(str(e.get("name") or ""))
        start_ms = round((int(e["ts_ns"]) - origin) / 1e6, 6)
        if e.get("ph") == "X":
            dur_ns = max(int(e.get("dur_ns") or 0), 0)
            b = bars[cat]
            b["y"].append(lane)
            b["base"].append(start_ms)
            b["x"].append(round(dur_ns / 1e6, 6))
            b["customdata"].append([name, cat, round(dur_ns / 1e3, 3)])
        else:
            instants["y"].append(lane)
            instants["x"].append(start_ms)
            instants["customdata"].append([name, cat])
    fig = go.Figure()
    for cat in sorted(bars):
        b = bars[cat]
        fig.add_trace(go.Bar(
            name=_short(cat), orientation="h", y=b["y"], base=b["base"], x=b["x"], customdata=b["customdata"],
            hovertemplate=HOVER_BAR, marker={"color": category_colour(cat), "line": {"width": 0}},
        ))
    if instants["x"]:
        fig.add_trace(go.Scatter(
            name="instant events", mode="markers", y=instants["y"], x=instants["x"], customdata=instants["customdata"],
            hovertemplate=HOVER_INSTANT, marker={"symbol": "line-ns-open", "size": 12, "color": "#444"},
        ))
    shown = sum(len(b["x"]) for b in bars.values())
    heading = title or "Trace timeline"
    if total_events is not None and total_events > shown:
        heading += f" — showing the {shown} longest of {total_events} events"
    lane_order = list(lanes.values())
    fig.update_layout(
        title={"text": heading},
        barmode="overlay",
        bargap=0.25,
        hovermode="closest",
        height=max(320, 26 * len(lane_order) + 140),
        margin={"l": 10, "r": 10, "t": 50, "b": 40},
        xaxis={"title": {"text": "ms since trace start"}, "zeroline": False},
        yaxis={"type": "category", "categoryorder": "array", "categoryarray": lane_order,
               "autorange": "reversed", "automargin": True},
        legend={"title": {"text": "category"}},
        template="plotly_white",
        meta={"lanes": lane_order, "shown_events": shown, "total_events": total_events, "start_ns": origin},
    )
    return json.loads(fig.to_json())
